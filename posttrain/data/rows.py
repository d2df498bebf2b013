"""Checking the cells of one data row: every bad cell is a DataError naming file, row and column.

Cells whose meaning is unambiguous are normalised instead (a ground truth of 85.0 is the integer 85), and rows
that can run but will probably not do what was meant (a ground truth of null) are counted in `RowNotes`, which
says each kind once with the first file and row where it was seen.
"""

from __future__ import annotations

import math
from typing import Any


class DataError(ValueError):
    """A bad data file or row; the message names file, row and column."""


def missing_column(where: str, column: str, row: dict, option: str) -> DataError:
    return DataError(f"{where}: missing column '{column}' (columns: {sorted(row)}); if it is in another column, "
                     f"set {option} to that column's name")


def prompt_messages(value: Any, where: str) -> list[dict]:
    """A prompt cell as chat messages: a list of {role, content} (content a string) or a plain string (one user
    turn). Rejects an empty prompt: a model asked nothing learns nothing from the reward."""
    if isinstance(value, str):
        messages = [{"role": "user", "content": value}]
    elif isinstance(value, (list, tuple)) and value and all(isinstance(m, dict) for m in value):
        messages = []
        for i, m in enumerate(value):
            if "content" not in m:
                raise DataError(f"{where}, message {i}: no 'content' key (keys: {sorted(m)})")
            content, role = m["content"], m.get("role", "user")
            if not isinstance(content, str):
                what = "null" if content is None else f"a {type(content).__name__} ({content!r:.60})"
                raise DataError(f"{where}, message {i}: 'content' is {what}; it must be a string (posttrain trains "
                                "text-only models)")
            if not isinstance(role, str) or not role:
                raise DataError(f"{where}, message {i}: 'role' must be a string such as 'user', got {role!r:.60}")
            messages.append({"role": role, "content": content})
    else:
        raise DataError(f"{where}: expected a list of chat messages [{{'role','content'}}] or a string, "
                        f"got {value!r:.80}")
    if not any(m["content"].strip() for m in messages):
        raise DataError(f"{where}: the prompt is empty (no message has any text); remove the row or fill it in")
    return messages


def extra_info_of(value: Any, where: str) -> dict:
    """The extra_info cell as a dict (null = {}); a string or another type is an error, not silently dropped."""
    if value is None:
        return {}
    if isinstance(value, dict):
        return dict(value)
    raise DataError(f"{where}, column 'extra_info': expected a struct (a JSON object) or null, got "
                    f"{type(value).__name__} {value!r:.60}")


def data_source_of(value: Any, where: str, column: str) -> str:
    if isinstance(value, str) and value:
        return value
    raise DataError(f"{where}, column '{column}': expected the name of the data source (a non-empty string, e.g. "
                    f"'openai/gsm8k'), got {value!r:.60}")


def agent_name_of(value: Any, where: str, known: list[str] | None = None) -> str | None:
    """The `agent_name` cell (which environment runs the row's episodes): a name (one of `known`, where given), or
    None when absent or null."""
    if value is None or isinstance(value, float) and math.isnan(value):
        return None
    if not isinstance(value, str) or not value.strip():
        raise DataError(f"{where}, column 'agent_name': expected the name of an environment (e.g. 'tool_agent') or "
                        f"null, got {value!r:.60}")
    if known is not None and value not in known:
        raise DataError(f"{where}, column 'agent_name': no environment is registered as {value!r} (registered: "
                        f"{', '.join(known)})")
    return value


def with_tools_kwargs(extra_info: dict, where: str) -> dict:
    """extra_info with its `tools_kwargs` ({tool name: {create_kwargs, ...}}) checked; the entries a parquet struct
    column pads with null for tools this row does not name are dropped."""
    kwargs = extra_info.get("tools_kwargs")
    if kwargs is None:
        return extra_info
    if not isinstance(kwargs, dict) or not all(isinstance(v, dict) for v in kwargs.values() if v is not None):
        raise DataError(f"{where}, column 'extra_info': 'tools_kwargs' must map each tool name to its arguments "
                        f"({{'calc_gsm8k_reward': {{'create_kwargs': {{...}}}}}}), got {kwargs!r:.80}")
    return {**extra_info, "tools_kwargs": {name: v for name, v in kwargs.items() if v is not None}}


class RowNotes:
    """Things worth saying about a data set once: how many rows, and the first file and row."""

    def __init__(self):
        self.counts: dict[str, int] = {}
        self.first: dict[str, str] = {}

    def add(self, kind: str, where: str) -> None:
        self.counts[kind] = self.counts.get(kind, 0) + 1
        self.first.setdefault(kind, where)

    def messages(self) -> list[str]:
        return [f"{n} row{' has' if n == 1 else 's have'} {_NOTE_TEXT[k]} (first: {self.first[k]})"
                for k, n in self.counts.items()]


_NOTE_TEXT = {
    "null_truth": "a null or empty ground_truth: the rule scorers give their responses 0",
    "float_truth": "a whole-number float ground_truth such as 85.0: read as the integer (85), which the rule "
                   "scorers compare as '85'",
}


def ground_truth_of(value: Any, where: str, notes: RowNotes) -> Any:
    """The ground truth as the scorers should see it: 85.0 (a float column, as pandas writes integers next to a
    null) becomes 85; NaN is null. A null or empty one is kept and noted (a reward model or custom scorer may not
    need it)."""
    if isinstance(value, float) and math.isnan(value):
        value = None
    if value is None or (isinstance(value, str) and not value.strip()):
        notes.add("null_truth", where)
        return value
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        notes.add("float_truth", where)
        return int(value)
    return value
