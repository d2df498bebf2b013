"""One HTTP request's samples as they decode: the events of its scheduler handles merged, each sample's text
(chat.SampleText), its stop strings (a match cancels that sample), and the request's time limit.

`Generation.updates()` yields `Update`s in arrival order; a sample's last one has `finish` set. It raises
`RequestTimeout` when the deadline passes (every sample cancelled first), `GenerationFailed` when a sample ended in an
error (`ServerClosing` when the scheduler ended it as it closes), and `Cancelled` once `cancel()` stopped every sample
(the client went away); the caller calls `cancel()` in a `finally` as well.
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


class ServerClosing(GenerationFailed):
    """The scheduler ended the request's samples because it is closing (SIGTERM)."""


class Cancelled(Exception):
    """`cancel()` was called while the updates were being read (the client went away)."""


@dataclass
class Update:
    choice: int
    text: str  # text that may be sent now
    tokens: list[tuple] = field(default_factory=list)  # the sampled (id, log-prob, top log-probs)s it came from
    finish: str | None = None  # "stop" or "length" on a choice's last update


class Generation:
    """`handles[i]` decodes prompt i's `n` samples; choice i * n + j is its sample j.

    The handles are read on the event loop with `take` / `notify` (scheduler.Handle): one wake-up per decoding step
    reads every event that came, with no task or queue per handle and no timer per event (per token, those cost the
    event loop as much as the rest of the request). When no sample needs its text before its end (an answer sent
    whole, without stop strings), the reader is woken by final events only."""

    def __init__(self, handles: list, n: int, samples: list[SampleText], deadline: float):
        self.handles, self.n, self.samples, self.deadline = handles, n, samples, deadline
        self.finish: list[str | None] = [None] * len(samples)
        self._cancelled = self._expired = False
        self._ready: asyncio.Future | None = None

    def _expire(self) -> None:
        self._expired = True
        self._wake()

    def _wake(self) -> None:
        if self._ready is not None and not self._ready.done():
            self._ready.set_result(None)

    async def updates(self):
        loop = asyncio.get_running_loop()
        final = not any(sample.incremental for sample in self.samples)  # woken by final events only
        timer = loop.call_later(max(0.0, self.deadline - time.monotonic()), self._expire)
        try:
            left = len(self.samples)
            while left:
                if self._cancelled:
                    raise Cancelled
                arrived = [(i, event) for i, handle in enumerate(self.handles) for event in handle.take()]
                if not arrived:
                    if self._expired or time.monotonic() >= self.deadline:
                        self.cancel()
                        raise RequestTimeout
                    self._ready = loop.create_future()
                    if all([handle.notify(loop, self._wake, final) for handle in self.handles]):
                        await self._ready
                    continue
                for i, event in arrived:
                    update = self._update(i, event)
                    if update is not None:
                        left -= update.finish is not None
                        yield update
        finally:
            timer.cancel()

    def _update(self, i: int, event) -> Update | None:
        """What `event` of handle `i` adds to its choice (None: nothing)."""
        choice = i * self.n + event.sample
        sample = self.samples[choice]
        if self.finish[choice] is not None:
            return None
        if event.finish is None:
            if sample.stopped:
                return None
            text = sample.push(event.token, event.logprob, event.top, event.raw_logprob)
            tokens = [(event.token, sample.shown[-1], event.top)]  # as clients see them (docs/serve.md, logprobs)
            if sample.stopped:
                self.handles[i].cancel(event.sample)
                self.finish[choice] = "stop"
                return Update(choice, text + sample.finish(), tokens, "stop")
            return Update(choice, text, tokens)
        if event.finish == "error":
            self.cancel()
            raise GenerationFailed("decoding failed for this request")
        if event.finish not in ("stop", "length"):  # cancelled by the server (it is closing)
            self.cancel()
            raise ServerClosing("the server is shutting down: the request was ended before it finished")
        self.finish[choice] = event.finish
        return Update(choice, sample.finish(), [], event.finish)

    def cancel(self) -> None:
        """Every sample still decoding stopped (nothing to do once all have finished); a reader waiting for updates
        gets `Cancelled`."""
        if all(f is not None for f in self.finish):
            return
        for handle in self.handles:
            handle.cancel()
        self._cancelled = True
        self._wake()
