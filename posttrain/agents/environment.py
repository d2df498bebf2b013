"""What answers the policy between its turns, and the registry that picks it per row.

An environment instance lives for one episode. `reset(row)` gives the conversation's first messages and the tools
offered; after each assistant turn (already in `episode.messages`), `step(episode)` gives the messages to append
(role `tool` for tool results, `user` for a user or environment message), a reward, and whether the episode is over.
`step` may block (a tool, a simulator): it runs in a worker thread, and only its own episode waits for it. An
environment that raises is contained by the caller: its episode ends, counted.

A row picks its environment by its `agent_name` column (verl's name for it), else
`actor_rollout_ref.rollout.agent.default_agent_loop`. Environments join with `@register_environment("name")` on a
factory taking the run's agent settings (`AgentSettings`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Protocol

from .episode import Episode


@dataclass
class Reset:
    messages: list[dict]
    tools: list[dict] | None = None  # JSON schemas for the chat template's `tools=`


@dataclass
class Step:
    messages: list[dict] = field(default_factory=list)  # appended after the assistant turn (tool / user roles)
    reward: float = 0.0  # added to the episode's environment reward
    done: bool = False
    metrics: dict[str, float] = field(default_factory=dict)


class Environment(Protocol):
    def reset(self, row: dict) -> Reset: ...

    def step(self, episode: Episode) -> Step: ...

    def close(self) -> None: ...


ENVIRONMENTS: dict[str, Callable[..., Environment]] = {}


def register_environment(*names: str):
    """Decorator: `factory(settings) -> Environment` (one call per episode) under `names`."""
    def add(factory):
        for name in names:
            if name in ENVIRONMENTS:
                raise ValueError(f"an environment named {name!r} is already registered")
            ENVIRONMENTS[name] = factory
        return factory
    return add


def register_from_file(path: str) -> list[str]:
    """Register the environments a verl-layout agent-loop file names (`- name: NAME` / `_target_: pkg.mod.Class`):
    each target is an environment class or a factory; called with the run's agent settings when it takes an
    argument, else with none. verl's own agent-loop classes (an async `run()`, no `step`) cannot run here. A name
    already registered to the same target is left as it is; to another one, it is an error. Returns the names."""
    import importlib
    import inspect

    from omegaconf import OmegaConf

    names = []
    for entry in OmegaConf.to_container(OmegaConf.load(path)):
        name, target = str(entry["name"]), str(entry["_target_"])
        module, _, attr = target.rpartition(".")
        try:
            factory = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError, ValueError) as e:
            raise ValueError(f"{path}: agent loop {name!r}: cannot import {target!r} ({type(e).__name__}: {e})") from None
        if inspect.isclass(factory) and hasattr(factory, "run") and not hasattr(factory, "step"):
            raise ValueError(f"{path}: agent loop {name!r}: {target} is an agent-loop class with an async run(), which "
                             "does not run here; write the turn logic as an environment (reset / step, "
                             "docs/agents.md) and name that class")
        if not callable(factory):
            raise ValueError(f"{path}: agent loop {name!r}: {target} is not a class or a function")
        if ENVIRONMENTS.get(name) is not None and getattr(ENVIRONMENTS[name], "target", None) is factory:
            names.append(name)
            continue
        if name in ENVIRONMENTS:
            raise ValueError(f"{path}: agent loop {name!r}: an environment of that name is already registered "
                             f"(registered: {', '.join(sorted(ENVIRONMENTS))}); give the entry another name")
        register_environment(name)(_called_with_settings(factory))
        names.append(name)
    return names


def _called_with_settings(factory):
    """A factory of `settings` over `factory`: `factory(settings)` when it takes an argument, `factory()` else."""
    import inspect

    try:
        inspect.signature(factory).bind(None)
        takes_settings = True
    except TypeError:
        takes_settings = False
    except ValueError:  # no signature to read (a builtin): give it the settings
        takes_settings = True

    def make(settings):
        return factory(settings) if takes_settings else factory()
    make.target = factory
    return make
