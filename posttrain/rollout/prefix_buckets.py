"""Decoding attention over prompts of very different lengths: each slot's prefix read only as wide as its prompt.

The contiguous state (decode_state.py) holds every slot's prefix left-padded to the longest prompt, and one
shared-prefix product per step reads all of it: with one 32k-token context among short prompts, every slot pays
32k columns at every step, and so does a slot whose rows have all finished. Here the slots that rows still read are
sorted by prompt width and split into up to `MAX_BUCKETS` buckets (the split with the fewest columns read, each
bucket counted as `BUCKET_COST` more); each bucket's product reads only its widest prompt's columns. The leading
columns it skips are masked (-inf) in every one of its rows, so the softmax is the same. Used where it reads at
most `USE_BELOW` of the padded product's columns; not in static mode (CUDA graphs replay the tensors they recorded).
"""

from __future__ import annotations

import torch

MAX_BUCKETS = 4
BUCKET_COST = 1024  # slot-columns one more bucket's calls cost (a dozen small ops per layer)
USE_BELOW = 0.75  # buckets are used where they read at most this share of the padded columns


class Bucket:
    """Slots `slots` (ascending) read `width` prefix columns (the rightmost: prompts are left-padded) by the
    current rows `rows` (None: every row, in order); `local` is each row's place among slots x group (None: all of
    them, in order). The prefix views or copies are taken per layer on first use."""

    def __init__(self, slots: torch.Tensor, width: int, rows: torch.Tensor | None, local: torch.Tensor | None):
        self.slots, self.width, self.rows, self.local = slots, width, rows, local
        first = int(slots[0])
        self.start = first if bool((slots == torch.arange(first, first + len(slots), device=slots.device)).all()) \
            else None
        self._prefix: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def prefix(self, state, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(slots, kv_heads, width, head_dim) keys and values: a view where the slots are consecutive, else a copy
        (made once per layout)."""
        if layer not in self._prefix:
            P = state.prefix_keys[layer].shape[2]
            k = state.prefix_keys[layer][:, :, P - self.width:]
            v = state.prefix_values[layer][:, :, P - self.width:]
            if self.start is not None:
                k, v = k[self.start:self.start + len(self.slots)], v[self.start:self.start + len(self.slots)]
            else:
                k, v = k.index_select(0, self.slots), v.index_select(0, self.slots)
            self._prefix[layer] = (k, v)
        return self._prefix[layer]


def _split(widths: list[int]) -> tuple[int, list[tuple[int, int]]]:
    """The cheapest split of ascending `widths` into at most MAX_BUCKETS runs: (cost, [(start, end)]), a run costing
    its length x its last width + BUCKET_COST. Dynamic programming over the run ends, which are only worth placing
    where the width changes (the ends of runs of equal widths)."""
    n = len(widths)
    ends = [j for j in range(1, n + 1) if j == n or widths[j] != widths[j - 1]]
    counts = torch.tensor([0] + ends, dtype=torch.int64)  # rows before each candidate end
    last = torch.tensor([0] + [widths[j - 1] for j in ends], dtype=torch.int64)
    m, huge = len(ends), 2 ** 62
    prev = torch.full((m + 1,), huge, dtype=torch.int64)
    prev[0] = 0
    best_cost, best, back = None, [], []
    for _ in range(min(MAX_BUCKETS, m)):
        cur, arg = torch.full_like(prev, huge), torch.zeros(m + 1, dtype=torch.int64)
        for j in range(1, m + 1):
            c = prev[:j] + (counts[j] - counts[:j]) * last[j]
            i = int(torch.argmin(c))
            cur[j], arg[j] = min(int(c[i]), huge) + BUCKET_COST, i
        back.append(arg)
        if best_cost is None or int(cur[m]) < best_cost:
            best_cost, runs, j = int(cur[m]), [], m
            for arg_k in reversed(back):
                i = int(arg_k[j])
                runs.append((int(counts[i]), int(counts[j])))
                j = i
            best = runs[::-1]
        prev = cur
    return best_cost, best


def choose(state) -> list[Bucket] | None:
    """The buckets of the state's current layout, or None where the padded product reads few more columns."""
    P = state.prefix_keys[0].shape[2]
    n_rows, slots_total = len(state.prefix_bias), state.prefix_keys[0].shape[0]
    if n_rows == 0 or P == 0:
        return None
    device = state.prefix_bias.device
    placed = torch.arange(n_rows, device=device) if state.rows is None else state.rows  # slot x group + within
    slot = placed // state.group
    real = state.prefix_bias[:, 0, 0] == 0
    need = torch.where(real.any(-1), P - real.int().argmax(-1), torch.zeros_like(slot))
    read = torch.unique(slot)
    slot_need = torch.zeros(slots_total, dtype=need.dtype, device=device).scatter_reduce(0, slot, need, "amax")[read]
    order = torch.argsort(slot_need, stable=True)
    cost, runs = _split(slot_need[order].tolist())
    if cost > USE_BELOW * slots_total * P:
        return None
    buckets = []
    for start, end in runs:
        slots = read[order[start:end]].sort().values
        width = int(slot_need[order[start:end]].max())
        if len(runs) == 1 and state.rows is None:
            rows = local = None
        else:
            rows = torch.isin(slot, slots).nonzero().squeeze(1)
            local = torch.searchsorted(slots, slot[rows]) * state.group + placed[rows] % state.group
            if rows.equal(torch.arange(n_rows, device=device)):
                rows = None
            if local.equal(torch.arange(len(slots) * state.group, device=device)):
                local = None
        buckets.append(Bucket(slots, width, rows, local))
    return buckets


def grouped(x: torch.Tensor, prompts: int, group: int) -> torch.Tensor:
    """(prompts * group, kv, g, d) -> (prompts, kv, group * g, d): the queries of one prompt's samples together."""
    _, kv, g, d = x.shape
    return x.view(prompts, group, kv, g, d).transpose(1, 2).reshape(prompts, kv, group * g, d)


def ungrouped(x: torch.Tensor, group: int) -> torch.Tensor:
    """Inverse of `grouped`."""
    prompts, kv, gg, d = x.shape
    g = gg // group
    return x.view(prompts, kv, group, g, d).transpose(1, 2).reshape(prompts * group, kv, g, d)


def scatter_rows(x: torch.Tensor, rows: torch.Tensor | None, total: int) -> torch.Tensor:
    if rows is None:
        return x
    return x.new_zeros((total, *x.shape[1:])).index_copy_(0, rows, x)


def gather_rows(x: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
    return x if rows is None else x.index_select(0, rows)


def bucketed_attention(state, buckets: list[Bucket], layer: int, q: torch.Tensor, own: torch.Tensor,
                       value: torch.Tensor, scale: float) -> torch.Tensor:
    """One decoding step's attention, bucket by bucket: q (rows, kv, g, d), own (rows, kv, g, capacity) the scores
    against each row's own suffix, value its suffix buffer; returns (rows, kv, g, d). Each bucket's rows get one
    softmax over their prefix columns and their suffix, as the padded product's."""
    rows, kv, g, _ = q.shape
    P, capacity = state.prefix_keys[layer].shape[2], own.shape[-1]
    out = value.new_empty(rows, kv, g, value.shape[-1])
    own_probs = value.new_empty(rows, kv, g, capacity) if len(buckets) > 1 else None
    for b in buckets:
        pk, pv = b.prefix(state, layer)
        slots = pk.shape[0]
        q_grouped = grouped(scatter_rows(gather_rows(q, b.rows), b.local, slots * state.group), slots, state.group)
        shared = torch.matmul(q_grouped, pk.transpose(-1, -2))
        shared = gather_rows(ungrouped(shared, state.group), b.local)
        bias = gather_rows(state.bias, b.rows)[..., P - b.width:]
        # one op: scale, mask and the float32 upcast (the bias is float32)
        scores = torch.add(bias, torch.cat([shared, gather_rows(own, b.rows)], dim=-1), alpha=scale)
        probs = torch.softmax(scores, dim=-1)
        probs = probs.to(value.dtype)
        p_grouped = grouped(scatter_rows(probs[..., :b.width], b.local, slots * state.group), slots, state.group)
        prefix_out = gather_rows(ungrouped(torch.matmul(p_grouped, pv), state.group), b.local)
        if own_probs is None:
            out, own_probs = prefix_out, probs[..., b.width:]
        else:
            out.index_copy_(0, b.rows, prefix_out)
            own_probs.index_copy_(0, b.rows, probs[..., b.width:])
    own_out = torch.bmm(own_probs.reshape(rows * kv, g, capacity), value.view(rows * kv, capacity, -1))
    return out + own_out.view(rows, kv, g, -1)
