"""GSM8K rule scorer: the `#### N` answer convention that RL frameworks train against.

Strict mode is the usual training reward: it only trusts an explicit `#### N` near the end of the response, so the
policy is pushed to emit the answer in a machine-checkable form. Flexible mode takes the last number anywhere, which is
kinder for evaluating models that were not trained on the `####` format.
"""

from __future__ import annotations

import re
from fractions import Fraction

_STRICT = re.compile(r"#### (\-?[0-9\.\,]+)")
_FLEXIBLE = re.compile(r"(\-?[0-9\.\,]+)")
# Only the tail is searched in strict mode: a long response that mentions "#### 3" early (e.g. quoting the prompt)
# should not be graded on that, and bounding the search keeps scoring cheap on very long generations.
_TAIL_CHARS = 300


def _clean(text: str) -> str:
    """Drop thousands separators and dollar signs, which GSM8K answers and responses use inconsistently."""
    return text.replace(",", "").replace("$", "").strip()


def extract_answer(solution_str: str, method: str = "strict") -> str | None:
    """The answer a response commits to (cleaned), or None; used for scoring and for majority voting."""
    if method not in ("strict", "flexible"):
        raise ValueError(f"method must be 'strict' or 'flexible', got {method!r}")
    if method == "strict":
        matches = _STRICT.findall(solution_str[-_TAIL_CHARS:])
        if not matches:
            return None
        # Exactly the common rule: "#### 18." yields "18." and fails the exact match (flexible mode accepts it).
        return _clean(matches[-1]) or None
    for match in reversed(_FLEXIBLE.findall(solution_str)):
        cleaned = _clean(match).rstrip(".")
        if cleaned not in ("", "-", ".", "-."):
            return cleaned
    return None


def _as_number(text: str) -> Fraction | None:
    try:
        return Fraction(text)
    except (ValueError, ZeroDivisionError):
        return None


def compute_score(solution_str: str, ground_truth: str, method: str = "strict", format_score: float = 0.0,
                  score: float = 1.0) -> float:
    """`score` for the right answer, `format_score` for a found-but-wrong one, 0 when no answer is found.

    Strict compares strings exactly (after comma/$ stripping); flexible also accepts numerically equal values such as
    "18.00" for "18", since free-form answers are not normalised the way `#### N` answers are.
    """
    answer = extract_answer(solution_str, method)
    if answer is None:
        return 0.0
    truth = _clean(str(ground_truth))
    if answer == truth:
        return score
    if method == "flexible":
        a, t = _as_number(answer), _as_number(truth)
        if a is not None and t is not None and a == t:
            return score
    return format_score
