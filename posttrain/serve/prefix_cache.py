"""The keys and values of sequences the server decoded, kept so that a request continuing one (an agent program's
next call: the last prompt + its completion + new messages) computes only the tokens it adds.

An entry is a sequence's token ids and its keys and values: a held `BlockSequence` (its blocks in the server's block
pool, rollout/kv_blocks.py: the cache holds one reference on each, and a prompt resuming it references them too), or
per layer (1, kv_heads, L, head_dim) tensors as `DecodeState.past` gives them. A prompt reuses the longest common
prefix it has with any entry (the keys and values of a position depend only on the tokens up to it, so a prefix of an
entry's past is the past of that prefix), leaving at least its last token to compute (its logits are needed). Entries are indexed by blocks of `BLOCK` tokens:
a prompt's match is found among the (at most `CANDIDATES` most recently kept) entries that share its most whole
blocks, to the token; a match shorter than a block is not used (a shared chat-template header is not worth a
separate forward). An entry that is a prefix of another is dropped
(the longer one matches every prompt at least as far). Bounded by `budget` cached tokens, least recently used out
first; a hit removes nothing.

Entries hold keys and values computed on the weights of the time: whoever changes the weights clears the cache
(`Scheduler.paused` does), which starts a new weight `version`. Each entry carries the version it was computed on;
`put` refuses keys and values of another version (a sample that decoded across a pause: its first positions' keys
are the old weights', counted in `stale`) and `match` uses the current version's only.
"""

from __future__ import annotations

import collections
import itertools
import threading

import torch

from ..rollout.kv_blocks import BlockSequence

BLOCK = 16  # tokens per step of the index: a match shares at least one block; the longest is found to the token
MIN_REUSED_TOKENS = BLOCK  # a shorter match is prefilled as new
CANDIDATES = 8  # entries compared token by token per lookup (a lookup's cost stays flat however many are kept)


def _length(past) -> int:
    return past.length if isinstance(past, BlockSequence) else past[0][0].shape[2]


def _release(past) -> None:
    if isinstance(past, BlockSequence):
        past.release()


def _block_hashes(ids: list[int]) -> list[int]:
    """One hash per whole block of `ids`, each over every block before it too: equal hashes, (all but surely) the
    same first k blocks."""
    hashes, h = [], 0
    for k in range(len(ids) // BLOCK):
        h = hash((h, tuple(ids[k * BLOCK:(k + 1) * BLOCK])))
        hashes.append(h)
    return hashes


class _Entry:
    __slots__ = ("ids", "tensor", "past", "hashes", "version")

    def __init__(self, ids: tuple[int, ...], past, hashes: list[int], version: int):
        self.ids, self.tensor, self.past, self.hashes, self.version = ids, torch.tensor(ids), past, hashes, version


class PrefixCache:
    """Finds a prompt's longest kept prefix through an index of block hashes (a lookup costs a few dictionary reads
    per block of the prompt, whatever the number of sequences kept)."""

    def __init__(self, budget: int):
        if budget < 0:
            raise ValueError(f"prefix_cache_tokens={budget}: must be >= 0 (0: off)")
        self.budget = budget
        self.tokens = 0  # cached now
        self.evicted = 0  # sequences dropped for room
        self.version = 0  # of the weights: each `clear` starts a new one
        self.stale = 0  # sequences refused by `put` for being of an older version
        self._lock = threading.Lock()  # `clear` may come from any thread
        self._entries: collections.OrderedDict[tuple[int, ...], _Entry] = collections.OrderedDict()  # LRU first
        self._through: dict[int, dict[tuple[int, ...], None]] = {}  # block hash -> the sequences holding it
        self._ends: dict[int, dict[tuple[int, ...], None]] = {}  # block hash -> the sequences it is the last of

    def __len__(self) -> int:
        return len(self._entries)

    def match(self, prompt: list[int]):
        """(past, m): the keys and values of `prompt`'s first m tokens, the longest kept ones (at least
        `MIN_REUSED_TOKENS`, at most all but its last token); None if there are none. The sequence they come from
        becomes the most recently used. A block sequence's prefix is held anew: the caller releases it."""
        with self._lock:
            deepest = None
            for h in _block_hashes(prompt[:-1]):
                if h not in self._through:
                    break
                deepest = h
            if deepest is None:
                return None
            best, longest = None, 0
            ids = torch.tensor(prompt[:-1])
            holders = self._through[deepest]  # they share the same whole blocks: the rest decides, to the token
            for key in itertools.islice(reversed(holders), CANDIDATES):
                entry = self._entries[key]
                n = min(len(key), len(ids))
                if n <= longest or entry.version != self.version:
                    continue
                differ = (entry.tensor[:n] != ids[:n]).nonzero()
                common = int(differ[0]) if len(differ) else n
                if common > longest:
                    best, longest = entry, common
            if best is None or longest < MIN_REUSED_TOKENS:
                return None
            self._entries.move_to_end(best.ids)
            if isinstance(best.past, BlockSequence):
                return best.past.prefix(longest), longest
            keys, values = best.past
            return ([k[:, :, :longest] for k in keys], [v[:, :, :longest] for v in values]), longest

    def put(self, ids: list[int], past, version: int | None = None) -> None:
        """Keep `past`, the keys and values of the sequence `ids` computed on weight version `version` (None: the
        current one; another is refused: keys of older weights are never reused) (a block sequence is the cache's
        from now on: released when not kept or when dropped); kept sequences that are prefixes of it go, and the
        least recently used ones while over the budget."""
        key = tuple(ids)
        if _length(past) != len(key):
            _release(past)
            raise ValueError(f"keys and values of {_length(past)} positions for a sequence of {len(key)} tokens")
        if len(key) <= MIN_REUSED_TOKENS or len(key) > self.budget:
            _release(past)
            return
        hashes = _block_hashes(ids)
        tensor = torch.tensor(key)
        with self._lock:
            if version is not None and version != self.version:  # checked under the lock `clear` takes
                _release(past)
                self.stale += 1
                return
            if key in self._entries:
                self._entries.move_to_end(key)
                _release(past)
                return
            for other in self._through.get(hashes[-1], ()):  # is it a prefix of one kept?
                if len(other) > len(key) and bool((self._entries[other].tensor[:len(key)] == tensor).all()):
                    self._entries.move_to_end(other)
                    _release(past)
                    return
            prefixes = [other for h in hashes for other in self._ends.get(h, ()) if len(other) < len(key)
                        and bool((self._entries[other].tensor == tensor[:len(other)]).all())]
            for other in prefixes:
                self._drop(other)
            entry = _Entry(key, past, hashes, self.version)
            self._entries[key] = entry
            for h in hashes:
                self._through.setdefault(h, {})[key] = None
            self._ends.setdefault(hashes[-1], {})[key] = None
            self.tokens += len(key)
            while self.tokens > self.budget:
                self._drop(next(iter(self._entries)))
                self.evicted += 1

    def clear(self) -> None:
        """Forget every entry and start a new weight version (the weights may have changed)."""
        with self._lock:
            self.version += 1
            for entry in self._entries.values():
                _release(entry.past)
            self._entries.clear()
            self._through.clear()
            self._ends.clear()
            self.tokens = 0

    def _drop(self, key: tuple[int, ...]) -> None:
        entry = self._entries.pop(key)
        _release(entry.past)
        for h in entry.hashes:
            holders = self._through[h]
            del holders[key]
            if not holders:
                del self._through[h]
        ends = self._ends[entry.hashes[-1]]
        del ends[key]
        if not ends:
            del self._ends[entry.hashes[-1]]
        self.tokens -= len(key)
