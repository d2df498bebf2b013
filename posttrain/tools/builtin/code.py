"""The code interpreter of verl's example configs (`verl.tools.sandbox_fusion_tools.SandboxFusionTool`): runs the
`code` argument and answers with its stdout and stderr. It runs on the SandboxFusion server at
`config.sandbox_fusion_url` when one is set, else on the run's code settings (posttrain.reward.code: the
`reward_model.sandbox_fusion.url` server, or the local bubblewrap sandbox, with its opt-in and hidden folders).
Config as verl's: `default_timeout` (s, 30), `default_language` ("python"), `memory_limit_mb` (1024); a call may
give `timeout` (capped at default_timeout) and `language`. A run that did not finish (time or memory limit) is
answered with what it printed and why it stopped, where verl answers "no stdout here"."""

from __future__ import annotations

import dataclasses

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
        code = code if isinstance(code, str) else str(code)
        try:
            timeout = min(float(parameters.get("timeout", self.default_timeout)), self.default_timeout)
        except (TypeError, ValueError):
            timeout = self.default_timeout
        settings = dataclasses.replace(code_reward.current_settings(), run_timeout=timeout,
                                       memory_limit_mb=self.memory_limit_mb)
        if self.url:
            settings = dataclasses.replace(settings, url=self.url)
        result = code_reward.execute(code, parameters.get("language") or self.default_language, "", settings)
        text = result.stdout + result.stderr
        if result.status != "Finished":
            text += f"\n(execution stopped: {result.status}{': ' + result.reason if result.reason else ''})"
        return ToolResponse(text=text), 0.0, {"run_status": result.status == "Finished"}
