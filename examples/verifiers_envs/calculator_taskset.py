"""The tool task (`posttrain demo --task tools`) as a verifiers taskset: products of 3-4 digit numbers, a calculator
tool, reward 1.0 when the final answer is exactly the product.

Its tasks are the task's problems as posttrain/data/synthetic_tools.py draws them for a seed: the RL training
problems, then the held-out ones (hold out the last `held_out` tasks: `data.val_max_samples`). Train on it with
`data.environment=verifiers:examples/verifiers_envs/calculator_taskset.py:CalculatorTaskset`, or run the demo with
`posttrain demo --task tools --environment verifiers:examples/verifiers_envs/calculator_taskset.py:CalculatorTaskset`.

The tool is offered as `calculator(expression)`, the name and argument the SFT demonstrations use: the toolset has no
tool prefix (`TOOL_PREFIX = None`), so verifiers does not name it `<server>_calculator`.
"""

from __future__ import annotations

import verifiers.v1 as vf

from posttrain.data.calculator import CalculatorError, calculate
from posttrain.data.synthetic_tools import prompt_text, sample_pairs
from posttrain.reward.tool_answer import extract_integer

__all__ = ["CalculatorTaskset"]


class CalculatorConfig(vf.TasksetConfig):
    """Which problems load: those of `synthetic_tools.write_task(seed=seed, train=train, dev=dev,
    held_out=held_out)` (the dev problems are the SFT's, so they are skipped)."""

    seed: int = 0
    train: int = 2000
    dev: int = 200
    held_out: int = 200


class Calculator(vf.Toolset):
    TOOL_PREFIX = None  # tools keep their own names: `calculator`, as the demonstrations call it

    @vf.tool
    async def calculator(self, expression: str) -> str:
        """Evaluate integer arithmetic exactly: integers combined with + - * / // and parentheses, e.g. "1234*567"."""
        try:
            return calculate(expression)
        except CalculatorError as e:
            return f"error: {e}"


class ProductData(vf.TaskData):
    answer: str


class ProductTask(vf.Task[ProductData]):
    @classmethod
    def toolsets(cls, config):
        return [Calculator(vf.ToolsetConfig())]

    @vf.reward
    async def exact_product(self, task: ProductData, trace: vf.Trace) -> float:
        """1.0 when the last reply is exactly the product (blanks and one final period allowed), as
        posttrain/reward/tool_answer.py scores the task."""
        answer = extract_integer(trace.last_reply or "")
        return float(answer is not None and answer == task.answer)


class CalculatorTaskset(vf.Taskset[ProductTask, CalculatorConfig]):
    def load(self):
        c = self.config
        pairs = sample_pairs(c.seed, c.train + c.dev + c.held_out)
        for a, b in pairs[:c.train] + pairs[c.train + c.dev:]:
            yield ProductTask(ProductData(prompt=prompt_text(a, b), answer=str(a * b)), self.config.task)
