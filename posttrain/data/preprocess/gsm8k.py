"""GSM8K original rows (`question`, `answer` ending in `#### N`) -> RL data layout rows scored by reward.gsm8k."""

from __future__ import annotations

from pathlib import Path

from ..dataset import layout_row, read_jsonl, tool_agent_row
from . import require_field

DATA_SOURCE = "openai/gsm8k"
# The instruction matches what the strict scorer looks for, so a model can earn reward by following the prompt.
INSTRUCTION = ' Let\'s think step by step and output the final answer after "####".'
# The tool-agent layout (`tools=True`) is verl's: its system prompt offers the answer-checking tool, whose instance is
# created with the row's ground truth (extra_info.tools_kwargs).
TOOL = "calc_gsm8k_reward"
TOOL_SYSTEM = ("You are a math expert. You are given a question and you need to solve it step by step. "
               "Reasoning step by step before any tool call. "
               f"You should use the `{TOOL}` tool after step by step solving the question, "
               "before generate final answer at least once and refine your answer if necessary. "
               "Put your final answer in the format of `#### <answer>`.")
TOOL_INSTRUCTION = " Let's think step by step and output the final answer after `####`."


def ground_truth_of(solution: str) -> str | None:
    """The reference answer after the last `####`, commas removed (as the scorer compares it), or None."""
    if "####" not in solution:
        return None
    answer = solution.rsplit("####", 1)[1].strip().replace(",", "")
    return answer or None


def convert(input_path: str | Path, split: str, tools: bool = False) -> list[dict]:
    """All rows of one original GSM8K jsonl file in the RL data layout (`tools`: the tool-agent layout); `index`
    counts rows within the split."""
    rows = []
    for index, (lineno, row) in enumerate(read_jsonl(input_path)):
        question = require_field(row, "question", input_path, lineno)
        solution = require_field(row, "answer", input_path, lineno)
        truth = ground_truth_of(solution)
        if truth is None:
            raise ValueError(f"{input_path}: line {lineno}: 'answer' has no final '#### N' line")
        extra_info = {"split": split, "index": index, "answer": solution, "question": question}
        rows.append(tool_agent_row(DATA_SOURCE, TOOL_SYSTEM, question + TOOL_INSTRUCTION, truth, extra_info, TOOL)
                    if tools else layout_row(DATA_SOURCE, question + INSTRUCTION, truth, extra_info))
    return rows
