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
