"""The GSM8K answer tool of verl's tool-agent example (`verl.tools.gsm8k_tool.Gsm8kTool`): the model submits an
answer, the tool says how it was read and scores it against the row's ground truth (posttrain.reward.gsm8k, flexible
mode), as verl's does: the step reward is 0 for an improved answer and -0.05 for one that is not better than the last;
`calc_reward` is the score of the last answer."""

from __future__ import annotations

import threading

from ...reward import gsm8k
from ..stateful import BaseTool, ToolResponse


class Gsm8kTool(BaseTool):
    default_schema = {"type": "function", "function": {
        "name": "calc_gsm8k_reward",
        "description": "A tool for calculating the reward of gsm8k. (1.0 if parsed answer is correct, 0.0 if parsed "
                       "answer is incorrect or not correctly parsed)",
        "parameters": {"type": "object", "properties": {"answer": {
            "type": "string", "description": "The model's answer to the GSM8K math problem, must be a digits"}},
            "required": ["answer"]}}}

    def __init__(self, config: dict, tool_schema: dict | None = None):
        super().__init__(config, tool_schema)
        self._episodes: dict[str, dict] = {}
        self._lock = threading.Lock()

    def create(self, instance_id: str, ground_truth: str | None = None, **kwargs):
        if ground_truth is None:  # verl's agent loop passes create_kwargs={...} instead
            ground_truth = (kwargs.get("create_kwargs") or {}).get("ground_truth")
        with self._lock:
            self._episodes[instance_id] = {"response": "", "ground_truth": ground_truth, "reward": 0.0}
        return instance_id, ToolResponse()

    def execute(self, instance_id: str, parameters: dict, **kwargs):
        answer = parameters.get("answer", "")
        answer = answer if isinstance(answer, str) else str(answer)
        state = self._episodes[instance_id]
        state["response"] = answer if answer.startswith("#### ") else "#### " + answer
        reward = self.calc_reward(instance_id)
        step_reward = 0.0 if reward > state["reward"] else -0.05  # no credit for resubmitting an answer no better
        state["reward"] = reward
        return ToolResponse(text=f"Current parsed {answer=} {reward=}"), step_reward, {}

    def calc_reward(self, instance_id: str, **kwargs) -> float:
        state = self._episodes[instance_id]
        return gsm8k.compute_score(state["response"], str(state["ground_truth"]), method="flexible")

    def release(self, instance_id: str, **kwargs) -> None:
        with self._lock:
            self._episodes.pop(instance_id, None)
