"""The state of one decoding run: its sequences (rows), their keys and values, and their positions.

An RL step samples `n` responses per prompt. The prompt's keys and values (the *prefix*, one slot per prompt) are
computed and stored once; each of its `n` rows keeps only its own generated tokens (the *suffix*), and the decoding
attention (prefix_attention.py) reads both. The state is also the cache object the model's layers write into
(`update`), so it is passed to the model as its cache.

Rows can be removed (`keep`: finished ones dropped), added mid-run (`add`: a new prompt's slot, whose rows
start decoding at the current suffix column), and taken out with all they hold (`past`) to be put back with
appended tokens (the engine's `extend`). Every such change bumps `layout`: the tensors a recorded CUDA graph reads
are then new ones (cuda_graphs.py records anew).
"""

from __future__ import annotations

import torch

from . import prefix_buckets

FIRST_CAPACITY = 16  # suffix positions at first; the buffers grow by a quarter when full
DROP_SLOTS_SHARE = 0.75  # prefixes no row reads are freed once the read ones are at most this share of the slots
DROP_COLUMNS_MIN = 16  # unread suffix columns are dropped once there are at least this many (and a quarter)
STATIC_FIRST_CAPACITY = 256  # the same in static mode (CUDA graphs): doubling from here, each size recorded once


class DecodeState:
    """Prefix: per layer (slots, kv_heads, P, head_dim); `prefix_bias` (rows, 1, 1, P) float32 is 0 on a row's
    prompt tokens and -inf elsewhere (left padding). Suffix: per layer (rows, kv_heads, capacity, head_dim),
    zero-filled, column `length` written at each step by every row; attention runs over the whole buffer with
    `bias` masking the columns a row has not written (slicing it would make every product copy its operand),
    and the capacity grows by a quarter when full.

    A slot added with fewer rows than `group` (`add(rows=...)`: a sequence put back with appended tokens, a
    server's request) still takes `group` rows in the shared product (the others zeros): the price of one product
    per slot.

    Per row: `rows` its index among slots x `group` (None while that is the identity), `ids` the caller's id of
    its sequence, `positions` the position of its next token, `starts` the suffix column it began at (None while
    every row began at 0).

    `static`: the layout CUDA graphs need (buffers reserved before a step, the write column and the mask updated
    in place, the capacity doubling)."""

    def __init__(self, keys: list[torch.Tensor], values: list[torch.Tensor], prefix_mask: torch.Tensor, group: int,
                 max_new: int, *, static: bool = False, first_capacity: int | None = None):
        self.prefix_keys, self.prefix_values, self.group, self.max_new = keys, values, group, max_new
        self._prefix_buffers: list[tuple[torch.Tensor, torch.Tensor]] = []  # `_store_slots`' buffers, once used
        self.static = static
        bias = torch.zeros(prefix_mask.shape, dtype=torch.float32, device=prefix_mask.device)
        self.prefix_bias = bias.masked_fill(prefix_mask == 0, float("-inf")).repeat_interleave(group, 0)[:, None, None]
        self.rows: torch.Tensor | None = None
        self.positions = prefix_mask.sum(dim=-1).repeat_interleave(group)
        self.ids = torch.arange(len(self.positions), device=prefix_mask.device)
        self.starts: torch.Tensor | None = None
        if first_capacity is None:
            first_capacity = STATIC_FIRST_CAPACITY if static else FIRST_CAPACITY
        self.length, self.capacity = 0, min(max_new, first_capacity)
        self.keys: list[torch.Tensor | None] = [None] * len(keys)
        self.values: list[torch.Tensor | None] = [None] * len(keys)
        self.position = torch.tensor([0], device=prefix_mask.device)
        self.layout = 0
        self.columns_dropped = 0  # suffix columns no row read any more, dropped (`_drop_unread_columns`)
        self.graph = None  # static mode: the engine's recorded step over this state (cuda_graphs.DecodeStep)
        self._buckets: tuple[int, list | None] | None = None  # (layout, prefix buckets), see `buckets`
        self._step_bias()

    # ------------------------------------------------------------------ one decoding step

    def _step_bias(self) -> None:
        """`bias` (rows, 1, 1, P + capacity): the prompt's padding and the suffix positions not written yet at
        -inf, the same for every layer of a step; `position`: where this step's key and value go."""
        device = self.prefix_bias.device
        if self.static:
            self.position.fill_(self.length)  # in place: a recorded step reads this very tensor
        else:
            self.position = torch.tensor([self.length], device=device)
        columns = torch.arange(self.capacity, device=device)
        suffix = torch.zeros(self.capacity, device=device).masked_fill(columns > self.length, float("-inf"))
        suffix = suffix.expand(*self.prefix_bias.shape[:3], -1)
        if self.starts is not None:  # rows added mid-run: the columns before their first are not theirs
            suffix = suffix.masked_fill(columns < self.starts[:, None, None, None], float("-inf"))
        self.bias = torch.cat([self.prefix_bias, suffix], dim=-1)

    def buckets(self) -> list | None:
        """The prefix read in buckets of similar prompt width (prefix_buckets.py), chosen once per layout; None where
        the padded product reads few more columns, and in static mode."""
        if self._buckets is None or self._buckets[0] != self.layout:
            self._buckets = (self.layout, None if self.static else prefix_buckets.choose(self))
        return self._buckets[1]

    def reserve(self) -> None:
        """Static mode: every layer's buffers at the current capacity before the step (a recorded step cannot
        allocate them)."""
        for i, (pk, pv) in enumerate(zip(self.prefix_keys, self.prefix_values)):
            k = self.keys[i]
            if k is None or k.shape[2] < self.capacity:
                rows = len(self.prefix_bias)
                self.keys[i] = self._grown(pk.new_empty(rows, pk.shape[1], 0, pk.shape[3]), k)
                self.values[i] = self._grown(pv.new_empty(rows, pv.shape[1], 0, pv.shape[3]), self.values[i])

    def update(self, key_states, value_states, layer_idx, cache_kwargs=None, kwargs=None):
        """Write the current token's key and value; return the suffix buffers. (transformers passes the layer's
        extra arguments as `cache_kwargs` up to 5.23, as `kwargs` from 5.24; neither matters here.)"""
        k, v = self.keys[layer_idx], self.values[layer_idx]
        if k is None or k.shape[2] < self.capacity:
            k, v = self._grown(key_states, k), self._grown(value_states, v)
            self.keys[layer_idx], self.values[layer_idx] = k, v
        k.index_copy_(2, self.position, key_states[:, :, -1:])  # a tensor index: no recompiling per position
        v.index_copy_(2, self.position, value_states[:, :, -1:])
        return k, v

    def _grown(self, states: torch.Tensor, old: torch.Tensor | None) -> torch.Tensor:
        rows, heads, _, dim = states.shape
        new = states.new_empty(rows, heads, self.capacity, dim)
        kept = 0 if old is None else old.shape[2]
        if old is not None:
            new[:, :, :kept] = old
        new[:, :, kept:] = 0  # masked positions still enter the products: keep them finite
        return new

    def advance(self) -> None:
        """The current token is written in every layer: the next step writes the next column, each row's next
        token is one position further. The capacity grows by a quarter when full (static mode: doubles, so that
        few steps are recorded)."""
        self.length += 1
        self.positions = self.positions + 1
        if self.length == self.max_new:  # full: a further step needs `add` to allow more
            return
        if self.length == self.capacity and self.capacity < self.max_new:
            self._grow()
        elif self.static:  # the same tensors, one more position unmasked
            self.position.fill_(self.length)
            self.bias[..., self.bias.shape[-1] - self.capacity + self.length] = 0.0
            return
        self._step_bias()

    def _grow(self) -> None:
        grown = 2 * self.capacity if self.static else self.capacity + max(1, self.capacity // 4)
        self.capacity = min(self.max_new, grown)

    # ------------------------------------------------------------------ gaining and losing rows

    def keep(self, keep: torch.Tensor) -> None:
        """Continue with the current rows `keep` only."""
        rows = torch.arange(len(self.prefix_bias), device=keep.device) if self.rows is None else self.rows
        self.rows, self.prefix_bias, self.bias = rows[keep], self.prefix_bias[keep], self.bias[keep]
        self.positions, self.ids = self.positions[keep], self.ids[keep]
        if self.starts is not None:
            self.starts = self.starts[keep]
        self.keys = [None if k is None else k.index_select(0, keep) for k in self.keys]
        self.values = [None if v is None else v.index_select(0, keep) for v in self.values]
        self.layout += 1
        self._drop_unread_columns()

    def _drop_unread_columns(self) -> None:
        """Drop the suffix columns before every remaining row's first: no row reads them. A run whose rows are
        parked and resumed (multi-turn episodes: a resumed row's past is its prefix, its suffix starts anew) would
        otherwise attend over every column it ever wrote. Done once they are a quarter of the buffer, so the copy
        is paid rarely; not in static mode (a recorded step reads the buffers it was recorded with)."""
        if self.static or self.starts is None or not len(self.starts):
            return
        first = int(self.starts.min())
        if first < max(DROP_COLUMNS_MIN, self.capacity // 4):
            return
        self.keys = [None if k is None else k[:, :, first:].contiguous() for k in self.keys]
        self.values = [None if v is None else v[:, :, first:].contiguous() for v in self.values]
        self.length, self.capacity, self.max_new = self.length - first, self.capacity - first, self.max_new - first
        self.starts = self.starts - first
        self.columns_dropped += first
        self._step_bias()

    def add(self, keys: list[torch.Tensor], values: list[torch.Tensor], prefix_mask: torch.Tensor, ids: torch.Tensor,
            max_new: int, *, rows: torch.Tensor | None = None) -> None:
        """New slots (per layer (slots, kv_heads, P', head_dim) and their (slots, P') mask) with their `group` rows
        each (`rows`: that many, at most `group`, per slot), appended after the current rows with the caller's `ids`;
        they decode from the next step on, for up to `max_new` more steps. Slots no row reads any more are freed."""
        self._drop_unread_slots()
        device = self.prefix_bias.device
        old_width = self.prefix_keys[0].shape[2]
        self._store_slots(keys, values)
        width = self.prefix_keys[0].shape[2]
        pad = torch.nn.functional.pad

        def left(x: torch.Tensor, dim: int, value: float = 0.0) -> torch.Tensor:  # widened on the left to `width`
            extra = width - x.shape[dim]
            return x if extra == 0 else pad(x, (0, 0) * (x.dim() - 1 - dim) + (extra, 0), value=value)

        slots, new_slots = self.prefix_keys[0].shape[0] - keys[0].shape[0], keys[0].shape[0]
        counts = (torch.full((new_slots,), self.group, device=device) if rows is None else rows.to(device))
        firsts = counts.cumsum(0) - counts  # each slot's first new row
        within = torch.arange(int(counts.sum()), device=device) - firsts.repeat_interleave(counts)
        new_rows = (slots + torch.arange(new_slots, device=device)).repeat_interleave(counts) * self.group + within
        bias = torch.zeros(prefix_mask.shape, dtype=torch.float32, device=device)
        bias = bias.masked_fill(prefix_mask == 0, float("-inf")).repeat_interleave(counts, 0)[:, None, None]
        old_rows = torch.arange(len(self.prefix_bias), device=device) if self.rows is None else self.rows
        self.rows = torch.cat([old_rows, new_rows])
        old_bias = self.prefix_bias if width == old_width else left(self.prefix_bias, 3, float("-inf"))
        self.prefix_bias = torch.cat([old_bias, left(bias, 3, float("-inf"))])
        added = len(new_rows)
        self.positions = torch.cat([self.positions, prefix_mask.sum(-1).repeat_interleave(counts)])
        self.ids = torch.cat([self.ids, ids.to(device)])
        starts = self.starts if self.starts is not None else self.positions.new_zeros(len(old_rows))
        self.starts = torch.cat([starts, starts.new_full((added,), self.length)])
        for buffers in (self.keys, self.values):
            for i, b in enumerate(buffers):
                if b is not None:
                    buffers[i] = torch.cat([b, b.new_zeros(added, *b.shape[1:])])
        self.max_new = max(self.max_new, self.length + max_new)
        while self.length >= self.capacity and self.capacity < self.max_new:
            self._grow()
        self.layout += 1
        self._step_bias()

    def _store_slots(self, keys: list[torch.Tensor], values: list[torch.Tensor]) -> None:
        """Append slots (per layer (slots, kv_heads, P', head_dim), left-padded) to the prefix. The prefix lives in
        buffers with room for more slots (a third more at each growth) and a width a quarter wider than needed, so
        that a run adding slots one batch at a time (episodes resuming) copies what it holds rarely, not at every
        addition; `prefix_keys` / `prefix_values` are views of the slots in use, left-padded to the buffers' width."""
        used, width = self.prefix_keys[0].shape[0], self.prefix_keys[0].shape[2]
        new, need = keys[0].shape[0], keys[0].shape[2]
        capacity = self._prefix_buffers[0][0].shape[0] if self._prefix_buffers else used
        if need > width or used + new > capacity or not self._prefix_buffers:
            width = max(width, need + need // 4) if need > width else width
            capacity = max(used + new, used + used // 3 + new)
            buffers = []
            for k, v in zip(self.prefix_keys, self.prefix_values):
                bk = k.new_zeros(capacity, k.shape[1], width, k.shape[3])
                bv = v.new_zeros(capacity, v.shape[1], width, v.shape[3])
                bk[:used, :, width - k.shape[2]:] = k
                bv[:used, :, width - v.shape[2]:] = v
                buffers.append((bk, bv))
            self._prefix_buffers = buffers
        for (bk, bv), k, v in zip(self._prefix_buffers, keys, values):
            bk[used:used + new, :, :width - need] = 0
            bv[used:used + new, :, :width - need] = 0
            bk[used:used + new, :, width - need:] = k
            bv[used:used + new, :, width - need:] = v
        self.prefix_keys = [bk[:used + new] for bk, _ in self._prefix_buffers]
        self.prefix_values = [bv[:used + new] for _, bv in self._prefix_buffers]

    def _drop_unread_slots(self) -> None:
        """Free the prefixes of slots whose rows have all been removed (a long run keeps adding slots), once they are
        a quarter of the slots (each freeing copies the prefixes kept; until then the unread ones cost a little
        compute in the attention's product)."""
        if self.rows is None:
            return
        read = torch.unique(self.rows // self.group)
        if len(read) > DROP_SLOTS_SHARE * self.prefix_keys[0].shape[0]:  # few unread: not worth a copy yet
            return
        self.prefix_keys = [k.index_select(0, read) for k in self.prefix_keys]
        self.prefix_values = [v.index_select(0, read) for v in self.prefix_values]
        self._prefix_buffers = []
        renumber = torch.zeros(int(read.max()) + 1 if len(read) else 1, dtype=torch.long, device=read.device)
        renumber[read] = torch.arange(len(read), device=read.device)
        self.rows = renumber[self.rows // self.group] * self.group + self.rows % self.group

    def past(self, row: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Row `row`'s keys and values per layer (1, kv_heads, L, head_dim): its prompt's, then those it wrote,
        in order — what an ordinary forward over its L tokens would hold."""
        slot = (row if self.rows is None else int(self.rows[row])) // self.group
        prompt = (self.prefix_bias[row, 0, 0] == 0).nonzero().squeeze(1)
        first = 0 if self.starts is None else int(self.starts[row])
        written = torch.arange(first, self.length, device=prompt.device)
        keys, values = [], []
        for layer, (pk, pv) in enumerate(zip(self.prefix_keys, self.prefix_values)):
            k, v = pk[slot, :, prompt], pv[slot, :, prompt]
            if self.keys[layer] is not None:
                k = torch.cat([k, self.keys[layer][row, :, written]], dim=1)
                v = torch.cat([v, self.values[layer][row, :, written]], dim=1)
            keys.append(k[None])
            values.append(v[None])
        return keys, values

    # ------------------------------------------------------------------ what transformers asks of a cache

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.prefix_keys[0].shape[2] + self.length

    def __len__(self) -> int:
        return len(self.keys)
