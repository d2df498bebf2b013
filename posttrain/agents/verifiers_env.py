"""verifiers environments (`data.environment=verifiers:<id>`): a taskset's tasks as prompt rows, and the agent
program that plays one task against an OpenAI-compatible endpoint and returns the task's rubric score.

verifiers runs a rollout as a harness program (a uv-installed script, its tools as MCP servers in subprocesses or
containers) behind its own interception proxy. Training runs the plain case in-process instead, which needs no
network, no uv and no sandbox: the chat loop here calls the endpoint with the OpenAI client it is given, runs the
task's and the taskset's `@vf.tool` methods directly (validated as their MCP servers would), and scores the finished
conversation with the task's `@vf.reward` functions (`Task.score` without a runtime). docs/agents.md says what is
mapped and what is refused.
"""

from __future__ import annotations

import asyncio
import functools
import importlib
import inspect
import json
import threading
from dataclasses import dataclass

from ..errors import ConfigError

PREFIX = "verifiers:"
DATA_SOURCE = "verifiers"
DEFAULT_MAX_TURNS = 10
INSTALL_HINT = "pip install 'posttrain[verifiers]'"


def _vf():
    """verifiers.v1, or a ConfigError saying how to install it."""
    try:
        import verifiers.v1 as vf
    except ImportError as e:
        raise ConfigError(f"data.environment names a verifiers environment, but verifiers is not installed ({e}); "
                          f"{INSTALL_HINT}") from None
    return vf


def _taskset_class(target: str):
    """The Taskset class `target` names: `pkg.module:Class` or `path/to/file.py:Class`, or a module (or installed
    taskset id) exporting exactly one Taskset subclass in `__all__`, as verifiers resolves ids."""
    vf = _vf()
    module_name, _, class_name = target.partition(":")
    if module_name.endswith(".py"):  # path/to/file.py:Class, as agent programs name a file's function
        from ..tools.targets import load_callable

        try:
            module = inspect.getmodule(load_callable(target))
        except ValueError as e:
            raise ConfigError(f"data.environment={PREFIX}{target}: {e}") from None
    else:
        try:
            module = (importlib.import_module(module_name) if "." in module_name or class_name
                      else vf.import_taskset(module_name))
        except ModuleNotFoundError as e:
            raise ConfigError(f"data.environment={PREFIX}{target}: {e}") from None
    names = [class_name] if class_name else list(getattr(module, "__all__", ()))
    found = [obj for name in names if isinstance(obj := getattr(module, name, None), type)
             and issubclass(obj, vf.Taskset) and obj is not vf.Taskset]
    if len(found) != 1:
        what = f"no Taskset class {class_name!r}" if class_name else f"{len(found)} Taskset subclasses in __all__"
        raise ConfigError(f"data.environment={PREFIX}{target}: module {module.__name__!r} has {what}; name one as "
                          f"{PREFIX}{module.__name__}:ClassName")
    return found[0]


@dataclass
class _Tool:
    owner: object  # the Toolset instance
    fn: object  # its bound @vf.tool method
    meta: object  # mcp's argument model: validates the model's arguments
    schema: dict  # the OpenAI tool schema


def _tools(toolsets) -> dict[str, _Tool]:
    """The `@vf.tool` methods of `toolsets`, named as verifiers' chat harness names them (`<server>_<tool>`)."""
    from mcp.server.mcpserver.utilities.func_metadata import func_metadata
    from verifiers.v1.utils.decorators import discover_decorated

    tools: dict[str, _Tool] = {}
    for toolset in toolsets:
        for fn in discover_decorated(toolset, "tool"):
            raw = getattr(fn, "tool_name", None) or fn.__name__
            name = f"{toolset.server_name}_{raw}" if toolset.server_name else raw
            if name in tools:
                raise ConfigError(f"verifiers environment: two tools are named {name!r}")
            meta = func_metadata(fn)
            tools[name] = _Tool(toolset, fn, meta, {"type": "function", "function": {
                "name": name, "description": (fn.__doc__ or "").strip(),
                "parameters": meta.arg_model.model_json_schema(by_alias=True)}})
    return tools


class VerifiersEnvironment:
    """One loaded taskset: its rows, and `rollout` (one task, one conversation, its rubric score)."""

    def __init__(self, spec: str):
        if not spec.startswith(PREFIX) or not spec[len(PREFIX):]:
            raise ConfigError(f"data.environment={spec!r}: expected '{PREFIX}<module or taskset id>'")
        vf = _vf()
        from verifiers.v1.utils.generic import concrete_type

        self.spec, target = spec, spec[len(PREFIX):]
        cls = _taskset_class(target)
        config_cls = concrete_type(cls, vf.TasksetConfig, origin=vf.Taskset) or vf.TasksetConfig
        self.taskset = cls(config_cls(id=target))
        self.task_cls = cls.task_type()
        if self.task_cls.NEEDS_CONTAINER:
            raise ConfigError(f"data.environment={spec}: its tasks need a container, which posttrain does not run")
        self._shared = cls.toolsets(self.taskset.config)  # one instance for every episode, as verifiers shares them
        for toolset in self._shared:
            asyncio.run(toolset.setup())

    def tasks(self, limit: int | None = None) -> list:
        """The taskset's tasks in `load()` order; an infinite taskset needs `limit`."""
        if self.taskset.INFINITE and limit is None:
            raise ConfigError(f"data.environment={self.spec} yields tasks forever; set data.train_max_samples")
        view = self.taskset if limit is None else self.taskset.take(limit)
        return list(view)

    def row(self, task, max_turns: int | None = None) -> dict:
        """A posttrain prompt row: the task's opening messages, and its data for the program to rebuild it."""
        from verifiers.v1.dialects.chat import message_to_wire

        return {"prompt": [message_to_wire(m) for m in self.opening(task.data)], "data_source": DATA_SOURCE,
                "reward_model": {"ground_truth": task.key},  # the task's identity; the rubric is the scorer
                "extra_info": {"index": task.data.idx, "verifiers": {
                    "env": self.spec, "task": task.data.model_dump(mode="json", exclude_none=True),
                    "max_turns": max_turns or DEFAULT_MAX_TURNS}}}

    def opening(self, data) -> list:
        """System prompt (if any) and the task's prompt, as verifiers' chat harness opens the conversation."""
        vf = _vf()
        if data.prompt is None:
            raise ConfigError(f"data.environment={self.spec}: a task without a prompt (the user opens the "
                              "conversation) needs a user simulator, which posttrain does not run")
        opening = [vf.SystemMessage(content=data.system_prompt)] if data.system_prompt else []
        prompt = data.prompt
        return opening + ([vf.UserMessage(content=prompt)] if isinstance(prompt, str) else list(prompt))

    def task(self, data: dict):
        return self.task_cls(self.task_cls.data_type().model_validate(data), self.taskset.config.task)

    async def rollout(self, data: dict, client, model: str, max_turns: int = DEFAULT_MAX_TURNS) -> float | None:
        """Play the task with `client` (an AsyncOpenAI) until the model answers without tool calls or `max_turns`
        assistant turns; the rubric's weighted reward sum, None when a reward could not be computed offline."""
        vf = _vf()
        from verifiers.v1.dialects.chat import message_to_wire, response_from_wire
        from verifiers.v1.mcp.server import _call_state

        task = self.task(data)
        own = self.task_cls.toolsets(task.config)  # per-episode servers, as verifiers starts them per rollout
        for toolset in own:
            await toolset.setup()
            await toolset.setup_task(task)
        tools = _tools([*own, *self._shared])
        state_cls = next((t._state_cls for t in [*own, *self._shared] if t._state_cls is not vf.State), vf.State)
        state = state_cls()  # the episode's state: every tool call reads and writes it, rewards see trace.state
        messages, sampled = self.opening(task.data), []
        schemas, stop = [t.schema for t in tools.values()], "max_turns"
        for _ in range(max_turns):
            completion = await client.chat.completions.create(
                model=model, messages=[message_to_wire(m) for m in messages], **({"tools": schemas} if schemas else {}))
            reply = response_from_wire(completion).message
            sampled.append(len(messages))
            messages.append(reply)
            if not reply.tool_calls:
                stop = "agent_completed"
                break
            for call in reply.tool_calls:
                token = _call_state.set(state)
                try:
                    content = await _call_tool(tools, call)
                finally:
                    _call_state.reset(token)
                messages.append(vf.ToolMessage(tool_call_id=call.id, content=content, name=call.name))
        trace = _trace(vf, task, messages, sampled, [vf.Tool(**t.schema["function"]) for t in tools.values()], stop)
        trace.state = state
        await task.score(trace)
        rewards = trace.rewards.values()
        return None if any(r is None for r in rewards) else trace.reward


async def _call_tool(tools: dict[str, _Tool], call) -> str:
    """A tool's result as text; an unknown tool, bad arguments or a raising tool answer with the error, as an MCP
    server does, so the model can correct itself."""
    tool = tools.get(call.name)
    if tool is None:
        return f"Error: unknown tool {call.name!r}; the tools are {sorted(tools)}"
    try:
        arguments = json.loads(call.arguments or "{}")
        result = await tool.meta.call_fn_with_arg_validation(
            tool.fn, inspect.iscoroutinefunction(tool.fn), arguments, None)
    except Exception as e:  # noqa: BLE001 - the model sees every tool failure
        return f"Error executing tool {call.name}: {e}"
    if isinstance(result, str):
        return result
    import pydantic_core

    return pydantic_core.to_json(result, fallback=str).decode()


def _trace(vf, task, messages: list, sampled: list[int], tools: list, stop: str):
    """The conversation as a verifiers Trace (one branch), which the task's rewards read."""
    nodes = [vf.MessageNode(parent=i - 1 if i else None, message=m, sampled=i in sampled,
                            tools=tools if i == 0 else []) for i, m in enumerate(messages)]
    return vf.Trace(task=vf.TraceTask(type=type(task).__name__, data=task.data, key=task.key, hash=task.hash),
                    agent=vf.AgentInfo(config=vf.AgentConfig()), tools=tools, nodes=nodes, is_completed=True,
                    ok=True, stop_condition=stop)


_lock = threading.Lock()


@functools.lru_cache(maxsize=None)
def _cached(spec: str) -> VerifiersEnvironment:
    return VerifiersEnvironment(spec)


def load_environment(spec: str) -> VerifiersEnvironment:
    """The environment `spec` names, loaded once per process (programs run in threads)."""
    with _lock:
        return _cached(spec)


def environment_rows(spec: str, *, val_size: int = 0, train_limit: int = -1,
                     max_turns: int | None = None) -> tuple[list[dict], list[dict]]:
    """Training and validation rows: a taskset has no splits, so the last `val_size` tasks are held out for
    validation and the rest train (`train_limit` > 0 caps them)."""
    env = load_environment(spec)
    limit = None if train_limit < 0 else train_limit + max(val_size, 0)
    tasks = env.tasks(limit)
    val = tasks[len(tasks) - val_size:] if val_size > 0 else []
    train = tasks[:len(tasks) - len(val)]
    if not train:
        raise ConfigError(f"data.environment={spec}: {len(tasks)} tasks, none left for training after holding out "
                          f"data.val_max_samples={val_size}")
    return [env.row(t, max_turns) for t in train], [env.row(t, max_turns) for t in val]


_served: tuple[str, str] | None = None  # (base_url, its model): training serves one endpoint per rollout


async def _model_name(client, base_url: str) -> str:
    """The endpoint's served model (the first of its /models), asked once per endpoint."""
    global _served
    served = _served
    if served is None or served[0] != base_url:
        listed = await client.models.list()
        served = _served = (base_url, listed.data[0].id if listed.data else "default")
    return served[1]


def run_episode(row: dict, base_url: str, api_key: str) -> float | None:
    """The agent program of `data.environment`: the row's task played against `base_url` (its requests carry
    `api_key`, the episode's id) and scored by the task's rubric."""
    from openai import AsyncOpenAI

    spec = (row.get("extra_info") or {}).get("verifiers")
    if not isinstance(spec, dict) or "env" not in spec or "task" not in spec:
        raise ValueError("row has no extra_info['verifiers'] (rows of data.environment carry the task there)")
    env = load_environment(spec["env"])

    async def play() -> float | None:
        async with AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0) as client:
            model = await _model_name(client, base_url)
            return await env.rollout(spec["task"], client, model, int(spec.get("max_turns") or DEFAULT_MAX_TURNS))

    return asyncio.run(play())
