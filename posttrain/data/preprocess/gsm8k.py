"""GSM8K original rows (`question`, `answer` ending in `#### N`) -> RL data layout rows scored by reward.gsm8k."""

from __future__ import annotations

from pathlib import Path

from ..dataset import layout_row, read_jsonl
from . import require_field

DATA_SOURCE = "openai/gsm8k"
# The instruction matches what the strict scorer looks for, so a model can earn reward by following the prompt.
INSTRUCTION = ' Let\'s think step by step and output the final answer after "####".'


def ground_truth_of(solution: str) -> str | None:
    """The reference answer after the last `####`, commas removed (as the scorer compares it), or None."""
    if "####" not in solution:
        return None
    answer = solution.rsplit("####", 1)[1].strip().replace(",", "")
    return answer or None


def convert(input_path: str | Path, split: str) -> list[dict]:
    """All rows of one original GSM8K jsonl file in the RL data layout; `index` counts rows within the split."""
    rows = []
    for index, (lineno, row) in enumerate(read_jsonl(input_path)):
        question = require_field(row, "question", input_path, lineno)
        solution = require_field(row, "answer", input_path, lineno)
        truth = ground_truth_of(solution)
        if truth is None:
            raise ValueError(f"{input_path}: line {lineno}: 'answer' has no final '#### N' line")
        rows.append(layout_row(DATA_SOURCE, question + INSTRUCTION, truth,
                               {"split": split, "index": index, "answer": solution, "question": question}))
    return rows
