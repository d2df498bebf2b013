"""The keys and values of sequences the server decoded, kept so that a request continuing one (an agent program's
next call: the last prompt + its completion + new messages) computes only the tokens it adds.

An entry is a sequence's token ids and its keys and values per layer (1, kv_heads, L, head_dim), as
`DecodeState.past` gives them. A prompt reuses the longest common prefix it has with any entry (the keys and values
of a position depend only on the tokens up to it, so a prefix of an entry's past is the past of that prefix),
leaving at least its last token to compute (its logits are needed); a match shorter than `min_tokens` is not used
(a shared chat-template header is not worth a separate forward). An entry that is a prefix of another is dropped
(the longer one matches every prompt at least as far). Bounded by `budget` cached tokens, least recently used out
first; a hit removes nothing.

Entries hold keys and values computed on the weights of the time: whoever changes the weights clears the cache
(`Scheduler.paused` does).
"""

from __future__ import annotations

import collections
import threading

import torch

MIN_REUSED_TOKENS = 16  # a shorter match is prefilled as new


class PrefixCache:
    def __init__(self, budget: int, min_tokens: int = MIN_REUSED_TOKENS):
        if budget < 0:
            raise ValueError(f"prefix_cache_tokens={budget}: must be >= 0 (0: off)")
        self.budget, self.min_tokens = budget, max(1, min_tokens)
        self.tokens = 0  # cached now
        self.evicted = 0  # entries dropped for room
        self._lock = threading.Lock()  # `clear` may come from any thread
        self._entries: collections.OrderedDict[tuple[int, ...], tuple[torch.Tensor, object]] = \
            collections.OrderedDict()  # ids -> (ids as a tensor, past); least recently used first

    def __len__(self) -> int:
        return len(self._entries)

    def match(self, prompt: list[int]):
        """(past, m): the keys and values of `prompt`'s first m tokens, the longest reusable; None if under
        `min_tokens`. The entry becomes the most recently used."""
        with self._lock:
            return self._match(prompt)

    def _match(self, prompt: list[int]):
        if not self._entries or len(prompt) <= self.min_tokens:
            return None
        ids = torch.tensor(prompt)
        best, longest = None, 0
        for key, (cached, _) in self._entries.items():
            n = min(len(cached), len(ids))
            if n <= longest or key[0] != prompt[0]:
                continue
            differ = (cached[:n] != ids[:n]).nonzero()
            common = int(differ[0]) if len(differ) else n
            if common > longest:
                best, longest = key, common
        m = min(longest, len(prompt) - 1)
        if m < self.min_tokens:
            return None
        self._entries.move_to_end(best)
        keys, values = self._entries[best][1]
        return ([k[:, :, :m] for k in keys], [v[:, :, :m] for v in values]), m

    def put(self, ids: list[int], past) -> None:
        """Keep `past`, the keys and values of the sequence `ids`; older entries out while over the budget."""
        with self._lock:
            self._put(tuple(ids), past)

    def _put(self, key: tuple[int, ...], past) -> None:
        if not key or len(key) > self.budget:
            return
        cached = torch.tensor(key)
        for other, (other_ids, _) in list(self._entries.items()):
            n = min(len(other), len(key))
            if other[0] != key[0] or not bool((other_ids[:n] == cached[:n]).all()):
                continue
            if len(other) >= len(key):  # this sequence is a prefix of one kept already
                self._entries.move_to_end(other)
                return
            self._drop(other)  # a prefix of this one
        self._entries[key] = (cached, past)
        self.tokens += len(key)
        while self.tokens > self.budget:
            self._drop(next(iter(self._entries)))
            self.evicted += 1

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self.tokens = 0

    def _drop(self, key: tuple[int, ...]) -> None:
        del self._entries[key]
        self.tokens -= len(key)
