"""verl's `SandboxFusionTool` for the classes written over it (the ReTool recipe's `CustomSandboxFusionTool`) where
verl is not installed: `verl.tools.sandbox_fusion_tools` answers with this module while a user's module loads
(data/verl_compat.py). A YAML that names verl's class itself gets posttrain's built-in (builtin/code.py); both run
code the same way, through `builtin.code.run_code`, and answer the same text.

What a subclass uses is verl's: the constructor `(config, tool_schema)` (the schema a dict or verl's schema object),
`num_workers`, `rate_limit`, `enable_global_rate_limit`, `default_timeout`, `default_language`,
`sandbox_fusion_url`, `memory_limit_mb`, `execute_code(instance_id, code, timeout, language)` -> `ToolResponse`,
the async `create` / `execute` / `calc_reward` / `release`, and `self.execution_pool.execute.remote(fn, *args)`,
an awaitable of `fn(*args)`. There is no Ray: the pool runs `fn` in the calling thread (each tool call has a thread
and an event loop of its own, tools/runner.py), at most `num_workers` at once in this process, and at most
`rate_limit` with `enable_global_rate_limit` (verl's limit counts a whole cluster; here, one process).

Where the code runs, as the built-in and verl: on the SandboxFusion server at `sandbox_fusion_url` (SandboxFusion,
or `posttrain sandbox-server`, which listens at verl's default address, http://localhost:8080/run_code); with an
empty URL (verl refuses one) in this process's local bubblewrap sandbox, the run folder and data folders hidden.
Either way the call's `timeout` is capped at `default_timeout` and the run gets `memory_limit_mb`. Where verl differs:
a run that did not finish answers with what it printed and why it stopped (verl: "no stdout here"), a failure to run
at all is raised (a counted `tool_raised`; verl logs it and answers nothing), and `calc_reward` is the sum of the
instance's `reward` list, a number (verl returns the list, which no agent loop of verl reads)."""

from __future__ import annotations

import threading
from typing import Any, Callable
from uuid import uuid4

from .builtin.code import answer_text, capped_timeout, run_code
from .verl_base import BaseTool, OpenAIFunctionToolSchema, ToolResponse, rollout_trace_op


class _Remote:
    """`pool.execute.remote(fn, *args, **kwargs)`: an awaitable of the call, within the pool's slots."""

    def __init__(self, slots: threading.BoundedSemaphore):
        self.slots = slots

    def remote(self, fn: Callable, *args, **kwargs):
        async def run():
            with self.slots:
                return fn(*args, **kwargs)
        return run()


class ExecutionPool:
    """The stand-in for verl's Ray execution worker: `execute.remote(fn, *args)` runs `fn` here, `size` at a time."""

    def __init__(self, size: int):
        self.execute = _Remote(threading.BoundedSemaphore(size))

    def ping(self) -> bool:
        return True


def _positive_int(config: dict, key: str, default: int) -> int:
    value = config.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"config.{key} must be a positive integer, got {value!r}")
    return value


class SandboxFusionTool(BaseTool):
    def __init__(self, config: dict, tool_schema: OpenAIFunctionToolSchema | dict | None):
        super().__init__(config, tool_schema)
        self._instance_dict: dict[str, dict] = {}
        self.num_workers = _positive_int(config, "num_workers", 10)
        self.rate_limit = _positive_int(config, "rate_limit", 10)
        self.enable_global_rate_limit = bool(config.get("enable_global_rate_limit", True))
        self.default_timeout = config.get("default_timeout", 30)
        self.default_language = config.get("default_language", "python")
        self.sandbox_fusion_url = config.get("sandbox_fusion_url", "") or ""
        self.memory_limit_mb = _positive_int(config, "memory_limit_mb", 1024)
        if not isinstance(self.default_timeout, (int, float)) or isinstance(self.default_timeout, bool) \
                or not self.default_timeout > 0:
            raise ValueError(f"config.default_timeout must be a positive number of seconds, got "
                             f"{self.default_timeout!r}")
        size = min(self.num_workers, self.rate_limit) if self.enable_global_rate_limit else self.num_workers
        self.execution_pool = ExecutionPool(size)

    async def create(self, instance_id: str | None = None, ground_truth: str | None = None,
                     **kwargs) -> tuple[str, ToolResponse]:
        instance_id = instance_id if instance_id is not None else str(uuid4())
        self._instance_dict[instance_id] = {"response": "", "ground_truth": ground_truth, "reward": []}
        return instance_id, ToolResponse()

    @rollout_trace_op
    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs) -> tuple[ToolResponse, float, dict]:
        code = parameters.get("code", "")
        timeout = parameters.get("timeout", self.default_timeout)
        language = parameters.get("language", self.default_language)
        result = await self.execution_pool.execute.remote(self.execute_code, instance_id,
                                                          code if isinstance(code, str) else str(code), timeout,
                                                          language)
        if isinstance(result, ToolResponse):
            return result, None, None
        return ToolResponse(text=None if result is None else str(result)), None, None

    def execute_code(self, instance_id, code, timeout=30, language="python") -> ToolResponse:
        result = run_code(code, language or self.default_language, capped_timeout(timeout, self.default_timeout),
                          self.memory_limit_mb, self.sandbox_fusion_url or None)
        return ToolResponse(text=answer_text(result))

    async def calc_reward(self, instance_id: str, **kwargs) -> float:
        return float(sum(self._instance_dict.get(instance_id, {}).get("reward") or []))

    async def release(self, instance_id: str, **kwargs) -> None:
        self._instance_dict.pop(instance_id, None)
