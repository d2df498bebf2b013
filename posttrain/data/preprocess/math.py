"""MATH original rows (`problem`, `solution`, optional `answer`) -> RL data layout rows scored by reward.math."""

from __future__ import annotations

from pathlib import Path

from ...reward.math import extract_boxed
from ..dataset import layout_row, read_jsonl, tool_agent_row
from . import require_field

DATA_SOURCE = "DigitalLearningGmbH/MATH-lighteval"
# The instruction asks for the `\boxed{}` form that the scorer extracts.
INSTRUCTION = " Let's think step by step and output the final answer within \\boxed{}."
# The tool-agent layout (`tools=True`): a system prompt offering the code interpreter (the tool name of verl's
# code-interpreter configs), whose instance is created with the row's ground truth, as verl's math tool data has it.
TOOL = "code_interpreter"
TOOL_SYSTEM = ("You are a math expert. You are given a question and you need to solve it step by step. "
               f"You may use the `{TOOL}` tool to run Python code for any calculation; it returns what the code "
               "prints. Put your final answer within \\boxed{}.")


def convert(input_path: str | Path, split: str, tools: bool = False) -> list[dict]:
    """All rows of one original MATH jsonl file in the RL data layout (`tools`: the tool-agent layout).

    The ground truth is the `answer` field when the file has one (MATH-500 does), else the last `\\boxed{}` of the
    worked `solution` (the original MATH release has no separate answer field).
    """
    rows = []
    for index, (lineno, row) in enumerate(read_jsonl(input_path)):
        problem = require_field(row, "problem", input_path, lineno)
        solution = require_field(row, "solution", input_path, lineno)
        answer = row.get("answer")
        truth = answer.strip() if isinstance(answer, str) and answer.strip() else extract_boxed(solution)
        if not truth:
            raise ValueError(f"{input_path}: line {lineno}: no 'answer' field and no \\boxed{{}} answer in 'solution'")
        extra_info = {"split": split, "index": index, "answer": solution, "question": problem}
        rows.append(tool_agent_row(DATA_SOURCE, TOOL_SYSTEM, problem + INSTRUCTION, truth, extra_info, TOOL)
                    if tools else layout_row(DATA_SOURCE, problem + INSTRUCTION, truth, extra_info))
    return rows
