"""The run's tools, and an episode's session with them.

`ToolBox` loads the tools once per run (function tools and stateful tools by name) and gives their schemas;
`toolbox.open(tools_kwargs)` starts one episode's session (each stateful tool `create`s its instance);
`session.run(calls)` answers one assistant turn's calls, concurrently, each within its time limit; `session.reward()`
sums the stateful tools' `calc_reward`; `session.close()` releases the instances.

Nothing a tool or the model does raises out of a session: each failure is answered as the tool's result, an error
message the model reads, with a short kind (`ToolResult.error`) the caller counts:
  parse.py's kinds (malformed_json, missing_name, bad_arguments, unclosed_tag, nested_tag), and
  unknown_tool     the call names no tool of the run
  bad_arguments    a function tool's arguments miss a required one, name an unknown one, or have the wrong JSON type
  too_many_calls   the turn made more calls than max_parallel_calls (the first ones run, as verl's loop runs them)
  create_failed    the tool's create() raised or hung at the episode's start, so it cannot serve this episode
  tool_raised      the tool raised (sync or async)
  timeout          the tool did not answer within timeout_s; its call is abandoned (its thread left behind)
  bad_return       the tool returned something that is not str, dict, or (response, reward[, metrics])
  truncated        the answer was longer than max_tool_response_length and was cut (the call itself succeeded)
Failures outside a call are counted in `session.errors` (take_errors()): create_failed, reward_failed (calc_reward
raised, hung or gave no number: 0 is used), release_failed.
"""

from __future__ import annotations

import inspect
import math
import os
import uuid
from collections import Counter
from dataclasses import dataclass, field

from .answers import TRUNCATE_SIDES, BadReturn, argument_problem, read_return, truncate
from .function import FunctionTool, ToolLoadError, load_function_tools
from .parse import HOW_TO_CALL, ToolCall
from .runner import Outcome, run_all
from .stateful import load_tool_config

# verl's defaults for the multi_turn keys, used where a settings object lacks one
DEFAULTS = {"function_tool_path": None, "tool_config_path": None, "max_tool_response_length": 256,
            "tool_response_truncate_side": "middle", "max_parallel_calls": 1, "tool_timeout_s": 30.0}


@dataclass
class ToolResult:
    message: dict  # {"role": "tool", "content": ..., "name": ...}: what the model reads
    error: str | None = None  # the kind of failure (module docstring), None when the call succeeded
    seconds: float = 0.0
    reward: float = 0.0
    metrics: dict = field(default_factory=dict)


class ToolBox:
    def __init__(self, tools: list, *, max_tool_response_length: int | None = 256,
                 tool_response_truncate_side: str = "middle", max_parallel_calls: int = 1,
                 timeout_s: float | None = 30.0):
        if tool_response_truncate_side not in TRUNCATE_SIDES:
            raise ValueError(f"tool_response_truncate_side must be one of {TRUNCATE_SIDES}, "
                             f"got {tool_response_truncate_side!r}")
        self.tools = {}
        for tool in tools:
            if tool.name in self.tools:
                raise ToolLoadError(f"two tools are named {tool.name!r}: each tool name must be unique across "
                                    "function_tool_path and tool_config_path")
            self.tools[tool.name] = tool
        self.max_tool_response_length = max_tool_response_length
        self.truncate_side = tool_response_truncate_side
        self.max_parallel_calls = max_parallel_calls
        self.timeout_s = timeout_s

    @classmethod
    def from_settings(cls, settings=None, **fields) -> "ToolBox":
        """The tools an `AgentSettings` (or any object with its attribute names) names; keyword arguments override
        its attributes (`ToolBox.from_settings(function_tool_path=...)` needs no settings object)."""
        if isinstance(settings, (str, os.PathLike)):
            raise TypeError("ToolBox.from_settings takes a settings object; give paths by keyword "
                            "(function_tool_path=..., tool_config_path=...)")
        unknown = sorted(set(fields) - set(DEFAULTS))
        if unknown:
            raise TypeError(f"ToolBox.from_settings: unknown setting(s) {unknown}; known: {sorted(DEFAULTS)}")
        values = {k: getattr(settings, k, default) for k, default in DEFAULTS.items()} | fields
        tools = []
        if values["function_tool_path"]:
            tools += load_function_tools(values["function_tool_path"])
        if values["tool_config_path"]:
            tools += load_tool_config(values["tool_config_path"])
        return cls(tools, max_tool_response_length=values["max_tool_response_length"],
                   tool_response_truncate_side=values["tool_response_truncate_side"],
                   max_parallel_calls=values["max_parallel_calls"], timeout_s=values["tool_timeout_s"])

    def schemas(self) -> list[dict]:
        """The OpenAI function schemas, for the chat template's `tools=`."""
        return [t.schema if isinstance(t, FunctionTool) else _schema_dict(t.get_openai_tool_schema())
                for t in self.tools.values()]

    def open(self, tools_kwargs: dict | None = None) -> "ToolSession":
        return ToolSession(self, tools_kwargs or {})


class ToolSession:
    """One episode's tool state: an instance of each stateful tool, created at the start."""

    def __init__(self, box: ToolBox, tools_kwargs: dict):
        self.box, self.errors, self.closed = box, Counter(), False
        self.kwargs = {name: tools_kwargs.get(name) or {} for name in box.tools}
        stateful = [name for name, tool in box.tools.items() if not isinstance(tool, FunctionTool)]
        self.instances = {name: uuid.uuid4().hex for name in stateful}
        outcomes = self._lifecycle("create", stateful, "create_kwargs")
        self.create_failures = {name: _why(o) for name, o in zip(stateful, outcomes) if _why(o)}
        for name in self.create_failures:
            del self.instances[name]
            self.errors["create_failed"] += 1

    def run(self, calls: list[ToolCall], *, max_parallel_calls: int | None = None,
            timeout_s: float | None = None) -> list[ToolResult]:
        """A result per call, in order: the turn's first `max_parallel_calls` calls run at once, each within
        `timeout_s` (defaults: the toolbox's)."""
        cap = max_parallel_calls or self.box.max_parallel_calls
        timeout_s = self.box.timeout_s if timeout_s is None else timeout_s
        results: list[ToolResult | None] = [None] * len(calls)
        jobs, where = [], []
        for i, call in enumerate(calls):
            if i >= cap:
                results[i] = self._failed(call, "too_many_calls",
                                          f"at most {cap} tool call(s) run per turn; this one was not run")
                continue
            job_or_result = self._job(call)
            if isinstance(job_or_result, ToolResult):
                results[i] = job_or_result
            else:
                jobs.append(job_or_result)
                where.append(i)
        for i, outcome in zip(where, run_all(jobs, max_parallel=cap, timeout_s=timeout_s)):
            results[i] = self._answer(calls[i], outcome, timeout_s)
        return results

    def reward(self) -> float:
        """The sum of the stateful tools' `calc_reward` for this episode."""
        names = list(self.instances)
        total = 0.0
        for name, outcome in zip(names, self._lifecycle("calc_reward", names, "calc_reward_kwargs")):
            value = outcome.value
            if _why(outcome) or isinstance(value, bool) or not isinstance(value, (int, float)) \
                    or not math.isfinite(value):
                self.errors["reward_failed"] += 1
                continue
            total += float(value)
        return total

    def close(self) -> None:
        """Release every instance (once)."""
        if self.closed:
            return
        self.closed = True
        names = list(self.instances)
        for outcome in self._lifecycle("release", names, "release_kwargs"):
            if _why(outcome):
                self.errors["release_failed"] += 1

    def take_errors(self) -> dict[str, int]:
        """The failures outside calls counted since the last take."""
        errors, self.errors = dict(self.errors), Counter()
        return errors

    # ------------------------------------------------------------------ one call

    def _job(self, call: ToolCall):
        """A thunk that runs the call, or the result when it cannot run."""
        if call.error:
            return self._failed(call, call.error, f"{call.detail}. Write a call as {HOW_TO_CALL[call.format]}")
        tool = self.box.tools.get(call.name)
        if tool is None:
            return self._failed(call, "unknown_tool",
                                f"unknown tool {call.name!r}. Available tools: {sorted(self.box.tools)}")
        if isinstance(tool, FunctionTool):
            problem = argument_problem(call.arguments, tool.schema["function"].get("parameters"))
            if problem:
                return self._failed(call, "bad_arguments", f"tool {call.name!r}: {problem}")
            return lambda: tool.fn(**call.arguments)
        if call.name in self.create_failures:
            return self._failed(call, "create_failed", f"tool {call.name!r} is unavailable in this episode: "
                                                       f"its set-up failed ({self.create_failures[call.name]})")
        execute_kwargs = self.kwargs[call.name].get("execute_kwargs") or {}
        return lambda: tool.execute(self.instances[call.name], call.arguments, **execute_kwargs)

    def _answer(self, call: ToolCall, outcome: Outcome, timeout_s) -> ToolResult:
        if outcome.timed_out:
            return self._failed(call, "timeout", f"tool {call.name!r} did not answer within {timeout_s:g} s; the "
                                                 "call was abandoned", outcome.seconds)
        if outcome.exception is not None:
            return self._failed(call, "tool_raised", f"tool {call.name!r} failed: {_describe(outcome.exception)}",
                                outcome.seconds)
        try:
            text, reward, metrics = read_return(outcome.value)
        except BadReturn as e:
            return self._failed(call, "bad_return", f"tool {call.name!r} returned {e}", outcome.seconds)
        text, cut = truncate(text, self.box.max_tool_response_length, self.box.truncate_side)
        return ToolResult(_message(call, text), "truncated" if cut else None, outcome.seconds, reward, metrics)

    def _failed(self, call: ToolCall, kind: str, why: str, seconds: float = 0.0) -> ToolResult:
        text, _ = truncate(f"Error: {why}", self.box.max_tool_response_length, self.box.truncate_side)
        return ToolResult(_message(call, text), kind, seconds)

    def _lifecycle(self, method: str, names: list[str], kwargs_key: str) -> list[Outcome]:
        """`tool.<method>(instance_id, **tools_kwargs[name][kwargs_key])` for each named tool, at once, each within
        the time limit."""
        def job(name):
            fn = getattr(self.box.tools[name], method)
            kwargs = dict(self.kwargs[name].get(kwargs_key) or {})
            if method == "create" and _takes(fn, "create_kwargs"):  # as verl's agent loop passes them, too
                kwargs.setdefault("create_kwargs", dict(kwargs))
            return lambda: fn(self.instances[name], **kwargs)
        return run_all([job(n) for n in names], max_parallel=max(1, len(names)), timeout_s=self.box.timeout_s)


def _schema_dict(schema):
    """A tool's schema as the chat template takes it: a verl tool's pydantic `OpenAIFunctionToolSchema` dumped as
    verl's agent loop dumps it (fields set, none null)."""
    dump = getattr(schema, "model_dump", None)
    return dump(exclude_unset=True, exclude_none=True) if callable(dump) else schema


def _takes(fn, name: str) -> bool:
    """Whether `fn` accepts a keyword argument `name` (named, or through **kwargs)."""
    try:
        parameters = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return name in parameters or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())


def _message(call: ToolCall, text: str) -> dict:
    message = {"role": "tool", "content": text}
    if call.name:
        message["name"] = call.name
    return message


def _why(outcome: Outcome) -> str | None:
    if outcome.timed_out:
        return f"no answer within {outcome.seconds:.3g} s"
    if outcome.exception is not None:
        return _describe(outcome.exception)
    return None


def _describe(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"[:500]
