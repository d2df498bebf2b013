"""The run's history as the detectors read it: the logged metrics of the steps before this one (metrics.jsonl's
lines), and the two windows a trend compares — the run's first steps (the baseline) and its latest ones."""

from __future__ import annotations

import math
from dataclasses import dataclass
from statistics import median


class History:
    """Metric rows ({"step": n, key: value, ...}) in step order; a row may lack a key (not logged that step)."""

    def __init__(self, rows: list[dict] | None = None):
        self.rows = sorted(rows or [], key=lambda r: r.get("step", 0))

    def add(self, step: int, metrics: dict) -> None:
        self.rows.append({"step": step, **metrics})

    def series(self, key: str) -> list[tuple[int, float]]:
        """(step, value) of every row holding `key` with a finite value."""
        return [(r["step"], float(r[key])) for r in self.rows
                if isinstance(r.get(key), (int, float)) and math.isfinite(r[key])]

    def last(self, key: str) -> float | None:
        points = self.series(key)
        return points[-1][1] if points else None

    def recent(self, key: str, n: int) -> list[float]:
        return [v for _, v in self.series(key)[-n:]]

    def typical(self, key: str, n: int) -> float | None:
        """The median of the last `n` values (robust to one earlier spike); None without any."""
        values = self.recent(key, n)
        return median(values) if values else None


@dataclass(frozen=True)
class Trend:
    """A quantity's mean over the run's first `window` steps (baseline) and over the latest steps after them."""

    base: float
    now: float
    base_steps: tuple[int, int]
    now_steps: tuple[int, int]

    @property
    def change(self) -> float:
        return self.now - self.base

    def relative(self, floor: float = 1e-9) -> float:
        return (self.now - self.base) / max(abs(self.base), floor)

    def span(self) -> str:
        """"steps 1-5 -> 8-12": the two windows, for a message."""
        (a, b), (c, d) = self.base_steps, self.now_steps
        return f"steps {a}-{b} -> {c}-{d}"


def trend(history: History, key: str, current: float | None, step: int, window: int) -> Trend | None:
    """`key`'s baseline (the mean of its first `window` logged values) and now (the mean of the latest up to
    `window` values after the baseline, `current` at `step` among them); None until the baseline is complete and
    at least one later value exists. The two windows never share a step."""
    points = history.series(key) + ([(step, float(current))] if current is not None and math.isfinite(current)
                                    else [])
    if len(points) <= window or window < 1:
        return None
    base, later = points[:window], points[window:]
    now = later[-window:]
    return Trend(sum(v for _, v in base) / len(base), sum(v for _, v in now) / len(now),
                 (base[0][0], base[-1][0]), (now[0][0], now[-1][0]))
