"""Run blocking or async callables in threads, several at a time, each with a time limit.

Each job runs in a daemon thread of its own (an async one on a fresh event loop in that thread). A job still running
at its deadline is abandoned: its thread is left to finish or hang on its own and never blocks the caller or the
process's exit, and its outcome is a timeout. (A thread pool would keep the hung job's worker and join it at exit.)
"""

from __future__ import annotations

import asyncio
import inspect
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable


@dataclass
class Outcome:
    value: Any = None
    exception: BaseException | None = None
    timed_out: bool = False
    started: float = 0.0  # time.monotonic() when the job's thread started
    ended: float = 0.0  # when it answered, or when it was abandoned

    @property
    def seconds(self) -> float:
        return self.ended - self.started


def call(fn: Callable, *args, **kwargs):
    """`fn(*args, **kwargs)`, awaited on an event loop of this thread when it is a coroutine (verl's tools are
    async)."""
    value = fn(*args, **kwargs)
    if inspect.isawaitable(value):
        async def wait():
            return await value
        value = asyncio.run(wait())
    return value


def run_all(jobs: list[Callable[[], Any]], *, max_parallel: int, timeout_s: float | None) -> list[Outcome]:
    """The outcome of each job (in order), at most `max_parallel` running at once, each given `timeout_s` from its
    own start (None: no limit)."""
    if max_parallel < 1:
        raise ValueError(f"max_parallel must be at least 1, got {max_parallel}")
    outcomes = [Outcome() for _ in jobs]
    finished: queue.Queue[int] = queue.Queue()
    pending, running = list(range(len(jobs))), {}  # running: index -> deadline

    def work(i: int) -> None:
        try:
            outcomes[i].value = call(jobs[i])
        except BaseException as e:  # noqa: BLE001 - a tool's fault is an outcome, whatever it is
            outcomes[i].exception = e
        finished.put(i)

    while pending or running:
        while pending and len(running) < max_parallel:
            i = pending.pop(0)
            outcomes[i].started = time.monotonic()
            running[i] = outcomes[i].started + timeout_s if timeout_s is not None else None
            threading.Thread(target=work, args=(i,), daemon=True, name=f"tool-job-{i}").start()
        deadlines = [d for d in running.values() if d is not None]
        wait = max(0.0, min(deadlines) - time.monotonic()) if deadlines else None
        try:
            i = finished.get(timeout=wait)
            if i in running:  # (an abandoned job that answers late is ignored)
                outcomes[i].ended = time.monotonic()
                del running[i]
        except queue.Empty:
            pass
        now = time.monotonic()
        for i, deadline in list(running.items()):
            if deadline is not None and now >= deadline:
                outcomes[i].timed_out, outcomes[i].ended = True, now
                del running[i]
    return outcomes
