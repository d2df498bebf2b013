"""What a detector is: a pure function of the step (its batch's view, its metrics) and the run's history that returns
a `Reading` — the number logged as `watch/<name>`, a clause saying what moved, and example rows."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from .history import History, trend
from .view import StepView

BATCH, UPDATE, VALIDATION = "batch", "update", "validation"  # when a detector can run: see Detector.phase


@dataclass
class StepInput:
    step: int
    view: StepView | None = None  # the scored batch (phase batch and update)
    metrics: dict = field(default_factory=dict)  # the step's metrics so far (update: the update's; validation: val)
    tensors: dict = field(default_factory=dict)  # the batch's tensors after the update pass (update phase)


@dataclass
class Reading:
    value: float  # logged as watch/<name>, compared with the threshold
    note: str = ""  # what moved, for the warning line and the findings file
    rows: list[int] = field(default_factory=list)  # example rows of the batch, most telling first
    parts: dict[str, float] = field(default_factory=dict)  # logged as watch/<name>/<part>; later steps' history


@dataclass(frozen=True)
class Detector:
    name: str
    phase: str  # batch: before the update, on the scored batch; update: after it; validation: after validation
    fn: Callable[[StepInput, History, object], Reading]
    summary: str  # one line: what it watches (the report's and docs' table)


def acc_gain(inp: StepInput, history: History, s) -> tuple[float | None, str]:
    """The change of mean correctness between the baseline and latest windows (None until both exist), and a
    clause saying it."""
    view = inp.view
    current = sum(x.acc for x in view.samples) / len(view.samples) if view and view.samples else None
    t = trend(history, "reward/acc/mean", current, inp.step, s.window)
    return (None, "") if t is None else (t.change, f"accuracy {t.base:.2f} -> {t.now:.2f}")


def unexplained(raw: float, gain: float | None, s) -> float:
    """`raw` where correctness did not rise by `min_acc_gain` over the same windows, else 0 (explained)."""
    return raw if gain is None or gain < s.min_acc_gain else 0.0
