"""The final answer of a tool-using episode, scored by exact integer match.

In a multi-turn episode the response holds tool calls, tool results and the policy's last turn; only that last turn
is the answer (a number inside a tool call or a tool result must not count). The episode's conversation, when the
scorer gets it (`extra_info["messages"]`), names the last assistant message; otherwise the answer is the decoded text
after the last </tool_response> (without its role line), or the whole text if no tool answered.
"""

from __future__ import annotations

import re

_INTEGER = re.compile(r"\s*(-?\d+)\.?\s*")
_ROLE_LINE = re.compile(r"\s*(<\|im_end\|>\s*)?(<\|im_start\|>)?assistant\n")


def final_answer(solution_str: str, extra_info: dict | None = None) -> str:
    """The text of the episode's last assistant turn."""
    messages = (extra_info or {}).get("messages") if isinstance(extra_info, dict) else None
    if messages:
        said = [m for m in messages if isinstance(m, dict) and m.get("role") == "assistant"]
        return str(said[-1].get("content") or "") if said else ""
    _, marker, after = solution_str.rpartition("</tool_response>")
    if not marker:
        return solution_str
    role = _ROLE_LINE.match(after)
    return after[role.end():] if role else after


def extract_integer(text: str) -> str | None:
    """The integer that is the whole answer (surrounding blanks and one final period allowed), else None."""
    match = _INTEGER.fullmatch(text)
    return str(int(match.group(1))) if match else None


def score_integer_answer(solution_str: str, ground_truth, extra_info: dict | None = None) -> float:
    """1.0 when the final answer is exactly the integer `ground_truth`, else 0.0."""
    answer = extract_integer(final_answer(solution_str, extra_info))
    return float(answer is not None and answer == extract_integer(str(ground_truth)))
