"""One request's side of the scheduler: its events in order per sample (`Event`), read by one consumer (`Handle`:
from a thread, an event loop, or several handles at once from one loop), and the wake-ups of a decoding step sent
once per event loop (`_Wakes`). The scheduler (scheduler.py) puts events; the HTTP layer (generation.py) reads them."""

from __future__ import annotations

import asyncio
import collections
import threading
from dataclasses import dataclass
from typing import AsyncIterator, Iterator


@dataclass(slots=True)  # one per sampled token: slots make them cheaper to make and to keep
class Event:
    """One of a sample's tokens, or (token None) its end, with why in `finish`: "stop" (EOS or a stop id, which came
    as the sample's last token), "length" (max_tokens), "cancelled", "error"."""
    sample: int
    token: int | None
    logprob: float | None  # under the distribution the token was drawn from (greedy: the model's own)
    finish: str | None = None
    top: list[tuple[int, float]] | None = None  # the most likely (token, log-prob)s there, when the request asks
    raw_logprob: float | None = None  # under the model's own distribution (what clients see), when the request asks


class Handle:
    """A submitted request: its events, in order per sample, to one consumer; `cancel`.

    A consumer reads with `events` (a thread), `aevents` (an event loop), or `take` + `notify` (an event loop that
    reads several handles at once: generation.py)."""

    def __init__(self, scheduler, n: int):  # scheduler: the Scheduler whose `_cancel` ends its samples
        self.n = n
        self._scheduler = scheduler
        self._events: collections.deque[Event] = collections.deque()
        self._lock = threading.Lock()
        self._wake: tuple | None = None  # (loop or None, callback, final only): see `notify`
        self.prompt_logprobs: list | None = None  # echo: set by the scheduler before the first event

    def _put(self, events: list[Event], wakes: "_Wakes | None" = None) -> None:
        """Events to the consumer; its wake-up goes to `wakes` (run after the step) or runs now."""
        with self._lock:  # not while `notify` looks through the events
            self._events.extend(events)
            wake = self._wake
            if wake is None or (wake[2] and (not events or events[-1].finish is None)):
                return
            self._wake = None
        if wakes is None:
            _Wakes.now(wake)
        else:
            wakes.add(wake)

    def take(self) -> list[Event]:
        """The events that arrived, in order (none: [])."""
        events = self._events
        return [events.popleft() for _ in range(len(events))]

    def notify(self, loop: asyncio.AbstractEventLoop | None, callback, final: bool = False) -> bool:
        """`callback()` to run once on `loop` (None: in the scheduler thread) when events arrive; False (and nothing
        registered) if some are there already. `final`: only when a sample's final event arrives (a reader that
        needs no token before the end, such as an answer sent whole, is not woken once per token)."""
        with self._lock:
            if any(e.finish is not None for e in self._events) if final else self._events:
                return False
            self._wake = (loop, callback, final)
            return True

    def events(self, timeout: float | None = None) -> Iterator[Event]:
        """Every sample's events; ends after each sample's final one. TimeoutError when `timeout` seconds pass with
        no event. A consumer that leaves early (a break, an exception, the timeout) cancels what still runs."""
        open_samples = self.n
        try:
            while open_samples:
                while not self._events:  # a wake with nothing to read (an empty put) waits again
                    ready = threading.Event()
                    if self.notify(None, ready.set) and not ready.wait(timeout):
                        with self._lock:
                            self._wake = None
                        if not self._events:
                            raise TimeoutError(f"no event in {timeout} s")
                event = self._events.popleft()
                open_samples -= event.finish is not None
                yield event
        finally:
            if open_samples:
                self.cancel()

    async def aevents(self) -> AsyncIterator[Event]:
        """`events` for an asyncio consumer: it waits on the event loop, not in a thread. A consumer that leaves
        early (the generator closed: a client gone) cancels what still runs."""
        loop = asyncio.get_running_loop()
        open_samples = self.n
        try:
            while open_samples:
                while not self._events:  # a wake with nothing to read (an empty put) waits again
                    arrived = loop.create_future()
                    if self.notify(loop, lambda: arrived.done() or arrived.set_result(None)):
                        await arrived
                event = self._events.popleft()
                open_samples -= event.finish is not None
                yield event
        finally:
            if open_samples:
                self.cancel()

    def cancel(self, sample: int | None = None) -> None:
        """End sample `sample` (None: every sample) with finish "cancelled": its rows leave the batch before the next
        step. A sample that has ended already is left as it ended."""
        if sample is not None and not 0 <= sample < self.n:
            raise ValueError(f"sample {sample} of a request of n={self.n}")
        self._scheduler._cancel(self, sample)


class _Wakes:
    """The consumers to wake after a decoding step. Each event loop is woken once per step for all of its consumers:
    a wake is a write to the loop's self-pipe and a turn of the loop, and one per request per token cost the
    scheduler thread about a third of its time at 64 requests."""

    def __init__(self):
        self._by_loop: dict = {}

    def add(self, wake: tuple) -> None:
        loop, callback, _ = wake
        if loop is None:
            callback()
        else:
            self._by_loop.setdefault(loop, []).append(callback)

    def run(self) -> None:
        by_loop, self._by_loop = self._by_loop, {}
        for loop, callbacks in by_loop.items():
            try:
                loop.call_soon_threadsafe(_call_all, callbacks)
            except RuntimeError:  # the consumers' event loop is closed: nobody reads any more
                pass

    @staticmethod
    def now(wake: tuple) -> None:
        wakes = _Wakes()
        wakes.add(wake)
        wakes.run()


def _call_all(callbacks) -> None:
    for callback in callbacks:
        callback()
