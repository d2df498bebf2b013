"""What the server decoded for each episode, for training: every choice of every answered request, by episode id.

An episode id is the request's `X-Episode-Id` header, else its bearer key (an agent program's OpenAI client is
given its episode's id as `api_key`). A request that got no answer (timed out, client gone, refused) is not
recorded: the program never saw its tokens. `counts()`: what the server changed in the requests it recorded
(`seeds_dropped`: requests whose client seed was ignored, so that a row's runs draw different samples).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass


@dataclass
class Call:
    """One choice of one request."""
    prompt_ids: list[int]  # the exact ids the server decoded from (rendered chat + generation prompt)
    completion_ids: list[int]  # sampled ids, including the EOS / stop id when the sample ended on one
    logprobs: list[float]  # one per completion id, under the distribution it was drawn from (not what clients see)
    finish_reason: str


class Recorder:
    """Thread-safe store of each episode's calls (in the order answered) and reward."""

    def __init__(self):
        self._lock = threading.Lock()
        self._calls: dict[str, list[Call]] = {}
        self._rewards: dict[str, float] = {}
        self._counts: dict[str, int] = {}

    def record(self, episode: str, call: Call) -> None:
        with self._lock:
            self._calls.setdefault(episode, []).append(call)

    def set_reward(self, episode: str, reward: float) -> None:
        with self._lock:
            self._rewards[episode] = float(reward)

    def count(self, what: str, n: int = 1) -> None:
        with self._lock:
            self._counts[what] = self._counts.get(what, 0) + n

    def counts(self) -> dict[str, int]:
        """Every count since the recorder was made."""
        with self._lock:
            return dict(self._counts)

    def take(self, episode: str) -> tuple[list[Call], float | None]:
        """The episode's calls and reward (None when none was set), forgotten here."""
        with self._lock:
            return self._calls.pop(episode, []), self._rewards.pop(episode, None)
