"""The code interpreter of verl's example configs (`verl.tools.sandbox_fusion_tools.SandboxFusionTool`): runs the
`code` argument and answers with its stdout and stderr. It runs on the SandboxFusion server at
`config.sandbox_fusion_url` when one is set, else on the run's code settings (posttrain.reward.code: the
`reward_model.sandbox_fusion.url` server, or the local bubblewrap sandbox, with its opt-in and hidden folders).
Config as verl's: `default_timeout` (s, 30), `default_language` ("python"), `memory_limit_mb` (1024); a call may
give `timeout` (capped at default_timeout) and `language`. A run that did not finish (time or memory limit) is
answered with what it printed and why it stopped, where verl answers "no stdout here"."""

from __future__ import annotations

import dataclasses
import math

from ...reward import code as code_reward
from ..stateful import BaseTool, ToolResponse


class CodeInterpreterTool(BaseTool):
    default_schema = {"type": "function", "function": {
        "name": "code_interpreter", "description": "A tool for executing code.",
        "parameters": {"type": "object", "properties": {"code": {"type": "string",
                                                                  "description": "The code to execute."}},
                       "required": ["code"]}}}

    def __init__(self, config: dict, tool_schema: dict | None = None):
        super().__init__(config, tool_schema)
        self.url = self.config.get("sandbox_fusion_url") or None
        self.default_timeout = float(self.config.get("default_timeout", 30))
        self.default_language = self.config.get("default_language", "python")
        self.memory_limit_mb = int(self.config.get("memory_limit_mb", 1024))

    def execute(self, instance_id: str, parameters: dict, **kwargs):
        code = parameters.get("code", "")
        result = run_code(code if isinstance(code, str) else str(code), parameters.get("language") or
                          self.default_language, capped_timeout(parameters.get("timeout"), self.default_timeout),
                          self.memory_limit_mb, self.url)
        return ToolResponse(text=answer_text(result)), 0.0, {"run_status": result.status == "Finished"}


def capped_timeout(asked, default: float) -> float:
    """The seconds a call may run: what it asks, within (0, default]; the default when it asks nothing usable."""
    try:
        seconds = float(asked)
    except (TypeError, ValueError):
        return default
    return min(seconds, default) if math.isfinite(seconds) and seconds > 0 else default


def run_code(code: str, language: str, timeout: float, memory_limit_mb: int, url: str | None):
    """One run of a tool's code: on the SandboxFusion server at `url`, else as the run's code settings say (the
    local sandbox, the run folder and data hidden), within `timeout` seconds and `memory_limit_mb`."""
    settings = dataclasses.replace(code_reward.current_settings(), run_timeout=timeout, memory_limit_mb=memory_limit_mb)
    if url:
        settings = dataclasses.replace(settings, url=url)
    return code_reward.execute(code, language, "", settings)


def answer_text(result) -> str:
    """What the model reads: the run's stdout and stderr, and why it stopped when it did not finish."""
    text = result.stdout + result.stderr
    if result.status != "Finished":
        text += f"\n(execution stopped: {result.status}{': ' + result.reason if result.reason else ''})"
    return text
