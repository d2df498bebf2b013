"""What a reward function may return, and when a run with failing rewards must stop.

A reward is a finite number, or a dict with a finite `score` (other numeric entries must be finite too: they become
metrics and gdpo's reward components). Anything else (NaN, inf, None, a string, a dict without `score`) is not
trained on: the reward manager scores it 0 and counts it in `reward/errors`, so a NaN never reaches the loss.
A step in which too many responses failed to score stops the run (`reward_model.max_error_rate`): a broken reward
function should not train a model on zeros for days.
"""

from __future__ import annotations

import math
import numbers


class RewardError(RuntimeError):
    """Too many responses of a step failed to score; the message says how many and which key allows more."""


def as_number(value) -> float | None:
    """`value` as a finite float, or None when it is not one (strings are not numbers here, even "1.0")."""
    if not isinstance(value, numbers.Real) and callable(getattr(value, "item", None)):
        try:
            value = value.item()  # a one-element numpy / torch value; larger ones raise
        except Exception:
            return None
    if not isinstance(value, numbers.Real):
        return None
    number = float(value)
    return number if math.isfinite(number) else None


def _show(value) -> str:
    text = repr(value)
    return text if len(text) <= 120 else text[:117] + "..."


def unpack(value) -> tuple[float, dict[str, float], str | None]:
    """(score, numeric extras, problem): `problem` says why `value` is not a reward (score and extras then 0/{})."""
    if isinstance(value, dict):
        if "score" not in value:
            return 0.0, {}, f"a dict without 'score': {_show(value)}"
        score = as_number(value["score"])
        if score is None:
            return 0.0, {}, f"score={_show(value['score'])}, not a finite number"
        extras = {}
        for key, v in value.items():
            if key == "score" or not isinstance(v, numbers.Real):
                continue  # strings and the like (e.g. the extracted answer) are not metrics
            number = as_number(v)
            if number is None:
                return 0.0, {}, f"{key}={_show(v)}, not a finite number"
            extras[key] = number
        return score, extras, None
    score = as_number(value)
    if score is None:
        return 0.0, {}, f"{_show(value)} ({type(value).__name__}), not a finite number"
    return score, {}, None


def check_error_rate(errors: list[float], timeouts: list[float], max_rate: float, responses: int | None = None) -> None:
    """Raise RewardError when more than `max_rate` of the responses failed to score (raised, hung, crashed or
    returned something that is not a finite number). Called on the whole step's batch, the same on every rank;
    `responses`: how many were scored, when more than the rows (ReMax's greedy responses count on their rows)."""
    total = responses or max(len(errors), len(timeouts))
    failed = sum(errors) + sum(timeouts)
    if total and failed / total > max_rate:
        raise RewardError(
            f"{failed:g} of {total} responses in this step failed to score ({sum(errors):g} raised, crashed or "
            f"returned no finite number; {sum(timeouts):g} timed out), more than "
            f"reward_model.max_error_rate={max_rate:g}. The first failure of each kind is shown above. Fix the reward "
            f"function, or raise reward_model.max_error_rate (1 never stops)")
