"""MATH original rows (`problem`, `solution`, optional `answer`) -> RL data layout rows scored by reward.math."""

from __future__ import annotations

from pathlib import Path

from ...reward.math import extract_boxed
from ..dataset import layout_row, read_jsonl
from . import require_field

DATA_SOURCE = "DigitalLearningGmbH/MATH-lighteval"
# The instruction asks for the `\boxed{}` form that the scorer extracts.
INSTRUCTION = " Let's think step by step and output the final answer within \\boxed{}."


def convert(input_path: str | Path, split: str) -> list[dict]:
    """All rows of one original MATH jsonl file in the RL data layout.

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
        rows.append(layout_row(DATA_SOURCE, problem + INSTRUCTION, truth,
                               {"split": split, "index": index, "answer": solution, "question": problem}))
    return rows
