"""Bundled code problems (`posttrain/data/code/problems.jsonl`) -> RL data layout rows scored by reward.code."""

from __future__ import annotations

import json
from pathlib import Path

from ..dataset import layout_row, read_jsonl
from . import require_field

DATA_SOURCE = "posttrain/code"
BUNDLED = Path(__file__).resolve().parents[1] / "code" / "problems.jsonl"
# The instruction asks for the ```python block the scorer extracts.
INSTRUCTION = "\n\nWrite the solution in Python and put the complete program in one ```python code block."


def convert(input_path: str | Path, split: str) -> list[dict]:
    """Rows of the bundled file (or one in its format) whose `split` is `split`; the ground truth is the tests as
    a JSON string (the layouts reward.code accepts)."""
    rows = []
    for lineno, row in read_jsonl(input_path):
        if row.get("split", "train") != split:
            continue
        prompt = require_field(row, "prompt", input_path, lineno)
        tests = row.get("tests")
        if not isinstance(tests, (dict, list)) or not tests:
            raise ValueError(f"{input_path}: line {lineno} has no 'tests' object")
        extra = {"split": split, "index": len(rows), "task_id": row.get("task_id", f"line-{lineno}"),
                 "language": row.get("language", "python"), "solution": row.get("solution", "")}
        rows.append(layout_row(DATA_SOURCE, prompt + INSTRUCTION, json.dumps(tests), extra, ability="code"))
    return rows
