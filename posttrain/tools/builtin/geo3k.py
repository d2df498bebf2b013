"""The Geometry3K answer tool of verl's geo3k multi-turn example (`verl.tools.geo3k_tool.Geo3kTool`): the model
submits its answer, the tool grades it against the row's ground truth and says how it was read, as verl's does:
`Current parsed answer='…' reward=…`, a step reward of 0 for an answer better than the last and -0.05 for one that is
not, and `calc_reward` the grade of the last answer.

verl grades the submitted answer as it is (`use_boxed=False`, no format score) with mathruler's grader; here it is
graded by the scorer posttrain's geo3k rows use (posttrain.reward.math: the same text, or math-verify's equality), as
the boxed answer of a response would be."""

from __future__ import annotations

import threading

from ...reward import math
from ..stateful import BaseTool, ToolResponse


def grade(answer: str, ground_truth) -> float:
    """1.0 when `answer` (a bare answer, no `\\boxed{}` needed) equals `ground_truth`, else 0.0; never raises."""
    if not answer.strip() or ground_truth is None:
        return 0.0
    return math.compute_score(f"\\boxed{{{answer}}}", str(ground_truth))


class Geo3kTool(BaseTool):
    default_schema = {"type": "function", "function": {
        "name": "calc_geo3k_reward",
        "description": "A tool for calculating the reward of geo3k. (1.0 if parsed answer is correct, 0.0 if parsed "
                       "answer is incorrect or not correctly parsed)",
        "parameters": {"type": "object", "properties": {"answer": {
            "type": "string", "description": "The model's answer to the geo3k problem, must be a digits"}},
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
        state["response"] = answer
        reward = self.calc_reward(instance_id)
        step_reward = 0.0 if reward > state["reward"] else -0.05  # no credit for resubmitting an answer no better
        state["reward"] = reward
        return ToolResponse(text=f"Current parsed {answer=} {reward=}"), step_reward, {}

    def calc_reward(self, instance_id: str, **kwargs) -> float:
        state = self._episodes[instance_id]
        return grade(state["response"], state["ground_truth"])

    def release(self, instance_id: str, **kwargs) -> None:
        with self._lock:
            self._episodes.pop(instance_id, None)
