"""One progress display for every long command (RL and SFT training, `prepare`, `eval`, `export`): a rich bar with
done/total, elapsed time and ETA on a terminal; on anything else (CI, Slurm, a pipe) plain lines with the same
fields, written at every tenth of the work and for any unit finished more than a minute after the last line, so
that a log file stays readable."""

from __future__ import annotations

from time import monotonic

PLAIN_EVERY_S = 60.0  # a unit finished this long after the last plain-text line gets a line of its own


def _clock(seconds: float) -> str:
    seconds = int(max(seconds, 0))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


class ProgressBar:
    """`with ProgressBar("sft", total) as bar: ... bar.advance(); bar.print("a line above the bar")`.

    `enabled=False` shows no bar (`print()` still prints); `stderr=True` keeps stdout for a command's result."""

    def __init__(self, label: str, total: int, *, completed: int = 0, unit: str = "", enabled: bool = True,
                 stderr: bool = False):
        from rich.console import Console

        self.label, self.total, self.unit, self.enabled = label, max(int(total), 0), unit, enabled
        self.console = Console(stderr=stderr)
        self.live = enabled and self.console.is_terminal and not self.console.is_dumb_terminal
        self.done = self.first = min(max(int(completed), 0), self.total)  # `first`: done before (a resumed run)
        self.start = monotonic()
        self._last_line, self._last_tenth = self.start, 10 * self.done // self.total if self.total else 0
        self._rich = None
        if self.live:
            from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn,
                                       TimeRemainingColumn)

            self._rich = Progress(TextColumn(f"[bold]{label}"), MofNCompleteColumn(), BarColumn(),
                                  TimeElapsedColumn(), TextColumn("eta"), TimeRemainingColumn(),
                                  console=self.console, transient=False)
            self._task = self._rich.add_task(label, total=self.total, completed=self.done)
            self._rich.start()

    def __enter__(self) -> "ProgressBar":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def eta_s(self) -> float | None:
        """Seconds left at the mean pace so far (None before the first unit is done here)."""
        if self.done <= self.first:
            return None
        return (monotonic() - self.start) / (self.done - self.first) * (self.total - self.done)

    def line(self) -> str:
        """The plain-text form: `label 12/40 (30%) elapsed 0:01:02 eta 0:02:25`."""
        pct = 100 * self.done // self.total if self.total else 100
        eta = self.eta_s()
        unit = f" {self.unit}" if self.unit else ""
        return (f"{self.label} {self.done}/{self.total}{unit} ({pct}%) elapsed {_clock(monotonic() - self.start)}"
                f" eta {_clock(eta) if eta is not None else '?'}")

    def update(self, done: int) -> None:
        """Set the units done so far (not more than total)."""
        self.done = min(max(int(done), 0), self.total)
        if self._rich is not None:
            self._rich.update(self._task, completed=self.done)
        elif self.enabled and self.total:
            tenth = 10 * self.done // self.total
            now = monotonic()
            if tenth > self._last_tenth or now - self._last_line >= PLAIN_EVERY_S:
                self._last_tenth, self._last_line = tenth, now
                self.console.print(self.line(), highlight=False, markup=False, soft_wrap=True)

    def advance(self, units: int = 1) -> None:
        self.update(self.done + units)

    def print(self, message: str, *, markup: bool = False) -> None:
        """A line of output above the bar (on a terminal the bar stays at the bottom); `markup`: rich's [dim] etc."""
        self.console.print(message, highlight=False, markup=markup, soft_wrap=True)

    def close(self) -> None:
        if self._rich is not None:
            self._rich.stop()
            self._rich = None
