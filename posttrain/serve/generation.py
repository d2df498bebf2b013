"""One HTTP request's samples as they decode: the events of its scheduler handles merged, each sample's text
(chat.SampleText), its stop strings (a match cancels that sample), and the request's time limit.

`Generation.updates()` yields `Update`s in arrival order; a sample's last one has `finish` set. It raises
`RequestTimeout` when the deadline passes (every sample cancelled first), `GenerationFailed` when a sample ended in an
error, and `Cancelled` once `cancel()` stopped every sample (the client went away); the caller calls `cancel()` in a
`finally` as well.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from .chat import SampleText


class RequestTimeout(Exception):
    pass


class GenerationFailed(Exception):
    pass


class Cancelled(Exception):
    """`cancel()` was called while the updates were being read (the client went away)."""


@dataclass
class Update:
    choice: int
    text: str  # text that may be sent now
    tokens: list[tuple[int, float]] = field(default_factory=list)  # the sampled (id, log-prob)s it came from
    finish: str | None = None  # "stop" or "length" on a choice's last update


class Generation:
    """`handles[i]` decodes prompt i's `n` samples; choice i * n + j is its sample j."""

    def __init__(self, handles: list, n: int, samples: list[SampleText], deadline: float):
        self.handles, self.n, self.samples, self.deadline = handles, n, samples, deadline
        self.finish: list[str | None] = [None] * len(samples)
        self._tasks: list[asyncio.Task] = []
        self._queue: asyncio.Queue = asyncio.Queue()

    async def updates(self):
        queue = self._queue

        async def pump(i, handle):
            try:
                async for event in handle.aevents():
                    queue.put_nowait((i, event))
            except Exception as e:  # noqa: BLE001 - the scheduler's failure ends this request, not the server
                queue.put_nowait((i, e))

        self._tasks = [asyncio.ensure_future(pump(i, h)) for i, h in enumerate(self.handles)]
        left = len(self.samples)
        while left:
            try:
                i, event = await asyncio.wait_for(queue.get(), max(0.0, self.deadline - time.monotonic()))
            except asyncio.TimeoutError:
                self.cancel()
                raise RequestTimeout from None
            if event is None:
                raise Cancelled
            if isinstance(event, Exception):
                self.cancel()
                raise GenerationFailed(f"{type(event).__name__}: {event}")
            choice = i * self.n + event.sample
            sample = self.samples[choice]
            if self.finish[choice] is not None:
                continue
            if event.finish is None:
                if sample.stopped:
                    continue
                text = sample.push(event.token, event.logprob)
                tokens = [(event.token, event.logprob)]
                if sample.stopped:
                    self.handles[i].cancel(event.sample)
                    self.finish[choice] = "stop"
                    left -= 1
                    yield Update(choice, text + sample.finish(), tokens, "stop")
                else:
                    yield Update(choice, text, tokens)
                continue
            if event.finish == "error":
                self.cancel()
                raise GenerationFailed("decoding failed for this request")
            if event.finish not in ("stop", "length"):  # cancelled by the server (it is closing)
                self.cancel()
                raise GenerationFailed(f"the request was ended by the server ({event.finish})")
            self.finish[choice] = event.finish
            left -= 1
            yield Update(choice, sample.finish(), [], event.finish)

    def cancel(self) -> None:
        """Every sample still decoding stopped (nothing to do once all have finished)."""
        if all(f is not None for f in self.finish):
            return
        for handle in self.handles:
            handle.cancel()
        for task in self._tasks:
            task.cancel()
        self._queue.put_nowait((None, None))
