"""A decoding state whose keys and values live in blocks (kv_blocks.py): what a server's continuous batching runs on.

The same interface as `decode_state.DecodeState` (the model's layers write into it with `update`, the engine's
`step`, `add` and `keep` drive it, `past` takes a sequence out), a different layout: every row has a block table —
its slot's blocks (the prompt's whole blocks, held once per slot and read once per slot for all its rows, as the
contiguous prefix is), then its own blocks (the prompt's partly filled last block, shared by the prompt's rows until
each first writes into it and copies it, then the tokens it decoded). A row holds the blocks its tokens fill: it
takes a block when its last is full and gives all back when it leaves; nothing is reserved for its `max_new`, and a
row that joins late holds no column of the rows before it. A prompt whose first positions are a kept sequence's
(`add(reused=...)`: the prefix cache's) references that sequence's whole blocks instead of copying them.

The decoding attention (prefix_attention.py) gathers, per layer and step, each slot's blocks and each row's own
blocks into contiguous tensors and runs the same products as on the contiguous state.
"""

from __future__ import annotations

import torch

from .kv_blocks import BLOCK, BlockPool, BlockSequence


def _blocks(positions: int) -> int:
    return -(-positions // BLOCK)


class PagedDecodeState:
    """Rows in slots of up to `group` rows; per slot its whole shared blocks, per row its own blocks and how many
    positions they hold. `pool` (a `BlockPool`, made from the first keys when None) is shared with whoever keeps
    sequences beyond the state (a prefix cache). `ids`, `positions`, `layout`, `graph` as on `DecodeState`."""

    paged = True
    static = False
    graph = None

    def __init__(self, keys: list[torch.Tensor], values: list[torch.Tensor], mask: torch.Tensor, group: int, *,
                 pool: BlockPool | None = None, copies=None, rows: torch.Tensor | None = None,
                 reused: list[BlockSequence | None] | None = None):
        self.pool = BlockPool.like(keys[0], len(keys)) if pool is None else pool
        self.group = group
        self.slot_blocks: list[list[int]] = []  # per slot: its whole shared blocks (one reference per slot)
        self.slot_of: list[int] = []  # per row: its slot
        self.own: list[list[int]] = []  # per row: its own blocks (one reference each)
        self.own_length: list[int] = []  # per row: positions its own blocks hold
        self.ids = torch.zeros(0, dtype=torch.long, device=mask.device)
        self.layout = 0
        self.copies_on_write = 0  # shared partly filled blocks copied before a write
        self._ready = False
        self.add(keys, values, mask, torch.arange(0), 0, copies=copies, rows=rows, reused=reused)
        self.ids = torch.arange(len(self.slot_of), device=mask.device)

    # ------------------------------------------------------------------ gaining and losing rows

    def add(self, keys: list[torch.Tensor], values: list[torch.Tensor], mask: torch.Tensor, ids: torch.Tensor,
            max_new: int = 0, *, copies=None, rows: torch.Tensor | None = None,
            reused: list[BlockSequence | None] | None = None) -> None:
        """New prompts (per layer (prompts, kv_heads, W, head_dim), their (prompts, W) mask: a prompt's positions are
        its mask's ones, in order) join: `copies` slots each (one count per prompt, or one for all; None: 1), `rows`
        rows per slot (None: `group`), with the caller's `ids`. `reused[i]` (or None): a held sequence whose first
        positions are prompt i's — its whole blocks are referenced, not written. `max_new` is not needed (rows
        grow by blocks)."""
        prompts = mask.shape[0]
        device = mask.device
        copies = [1] * prompts if copies is None else (
            [int(copies)] * prompts if isinstance(copies, int) else [int(c) for c in copies])
        slots = sum(copies)
        counts = [self.group] * slots if rows is None else [int(r) for r in rows]
        if len(counts) != slots or any(not 0 < c <= self.group for c in counts):
            raise ValueError(f"rows per slot {counts}: need {slots} counts of 1 .. {self.group}")
        lengths = mask.sum(-1).tolist()
        src_rows, src_cols, dst_blocks, dst_offsets = [], [], [], []
        first_slot = 0
        for i in range(prompts):
            length = int(lengths[i])
            seq = None if reused is None else reused[i]
            kept = 0 if seq is None else min(seq.length, length - 1) // BLOCK  # whole blocks referenced
            whole, tail = length // BLOCK, length % BLOCK
            fresh = self.pool.allocate(whole - kept + (1 if tail else 0))
            if kept:
                self.pool.ref(seq.blocks[:kept])
            shared = (seq.blocks[:kept] if kept else []) + fresh[:whole - kept]
            columns = mask[i].nonzero().squeeze(1).tolist()[kept * BLOCK:]
            src_rows += [i] * len(columns)
            src_cols += columns
            for p in range(len(columns)):
                dst_blocks.append(fresh[p // BLOCK])
                dst_offsets.append((kept * BLOCK + p) % BLOCK)
            for c in range(copies[i]):
                if c:
                    self.pool.ref(shared)
                self.slot_blocks.append(list(shared))
            slot_rows = counts[first_slot:first_slot + copies[i]]
            own = [fresh[-1]] if tail else []
            if own and sum(slot_rows) > 1:
                self.pool.ref(own * (sum(slot_rows) - 1))
            for s, count in enumerate(slot_rows):
                slot = len(self.slot_blocks) - copies[i] + s
                for _ in range(count):
                    self.slot_of.append(slot)
                    self.own.append(list(own))
                    self.own_length.append(tail)
            first_slot += copies[i]
        if src_rows:
            src_r = torch.tensor(src_rows, device=device)
            src_c = torch.tensor(src_cols, device=device)
            dst_b = torch.tensor(dst_blocks, device=device)
            dst_o = torch.tensor(dst_offsets, device=device)
            for layer, (k, v) in enumerate(zip(keys, values)):
                pool_k, pool_v = self.pool.keys[layer], self.pool.values[layer]
                pool_k[:, dst_b, dst_o] = k[src_r, :, src_c].transpose(0, 1).to(pool_k.dtype)
                pool_v[:, dst_b, dst_o] = v[src_r, :, src_c].transpose(0, 1).to(pool_v.dtype)
        self.ids = torch.cat([self.ids, ids.to(device)])
        self.layout += 1
        self._ready = False

    def keep(self, keep: torch.Tensor) -> None:
        """Continue with the current rows `keep` only: the others' blocks go back (a slot's, once no row reads it)."""
        kept = keep.tolist()
        gone = set(range(len(self.slot_of))) - set(kept)
        for j in gone:
            self.pool.release(self.own[j])
        read = sorted({self.slot_of[j] for j in kept})
        for s in set(range(len(self.slot_blocks))) - set(read):
            self.pool.release(self.slot_blocks[s])
        renumber = {s: i for i, s in enumerate(read)}
        self.slot_blocks = [self.slot_blocks[s] for s in read]
        self.slot_of = [renumber[self.slot_of[j]] for j in kept]
        self.own = [self.own[j] for j in kept]
        self.own_length = [self.own_length[j] for j in kept]
        self.ids = self.ids[keep.to(self.ids.device)]
        self.layout += 1
        self._ready = False

    def release(self) -> None:
        """Every block the state holds back to the pool (the state is done)."""
        self.keep(torch.zeros(0, dtype=torch.long))

    # ------------------------------------------------------------------ one decoding step

    @property
    def positions(self) -> torch.Tensor:
        """Each row's next position (rows,)."""
        return torch.tensor([len(self.slot_blocks[s]) * BLOCK + n for s, n in zip(self.slot_of, self.own_length)],
                            device=self.ids.device)

    def _prepare(self) -> None:
        """Before a step's first write: each row's block for its next position (a new one when its last is full; a
        copy of its last when that is shared), where each row writes, and what the attention reads — per slot its
        blocks, per row its own, and `bias` (rows, 1, 1, slot columns + own columns) float32, -inf on the columns a
        row does not read."""
        pool, device = self.pool, self.ids.device
        write_blocks, write_offsets = [], []
        for j, (own, n) in enumerate(zip(self.own, self.own_length)):
            if n % BLOCK == 0:
                own.extend(pool.allocate(1))
            elif pool.refs[own[-1]] > 1:
                own[-1] = pool.writable(own[-1])
                self.copies_on_write += 1
            write_blocks.append(own[-1])
            write_offsets.append(n % BLOCK)
        self.write_block = torch.tensor(write_blocks, device=device)
        self.write_offset = torch.tensor(write_offsets, device=device)
        slot_width = max((len(b) for b in self.slot_blocks), default=0)
        own_width = max(len(o) for o in self.own)
        self.slot_table = torch.tensor([b + [0] * (slot_width - len(b)) for b in self.slot_blocks],
                                       dtype=torch.long, device=device).view(len(self.slot_blocks), slot_width)
        self.own_table = torch.tensor([o + [0] * (own_width - len(o)) for o in self.own], device=device)
        slot_of = torch.tensor(self.slot_of, device=device)
        slot_length = torch.tensor([len(b) * BLOCK for b in self.slot_blocks], device=device)[slot_of]
        own_length = torch.tensor(self.own_length, device=device)
        shared = torch.arange(slot_width * BLOCK, device=device) >= slot_length[:, None]
        own = torch.arange(own_width * BLOCK, device=device) > own_length[:, None]  # its write included
        masked = torch.cat([shared, own], dim=1)
        self.bias = torch.zeros(masked.shape, device=device).masked_fill(masked, float("-inf"))[:, None, None]
        within = [0] * len(self.slot_of)
        filled = [0] * len(self.slot_blocks)
        for j, s in enumerate(self.slot_of):
            within[j], filled[s] = filled[s], filled[s] + 1
        rows = slot_of * self.group + torch.tensor(within, device=device)
        identity = len(rows) == len(self.slot_blocks) * self.group and bool(
            (rows == torch.arange(len(rows), device=device)).all())
        self.rows = None if identity else rows
        self._ready = True

    def update(self, key_states, value_states, layer_idx, cache_kwargs=None, kwargs=None):
        """Write each row's current key and value into its block; return the layer's pool tensors (the attention
        reads through the block tables)."""
        if not self._ready:
            self._prepare()
        k, v = self.pool.keys[layer_idx], self.pool.values[layer_idx]
        k[:, self.write_block, self.write_offset] = key_states[:, :, -1].transpose(0, 1).to(k.dtype)
        v[:, self.write_block, self.write_offset] = value_states[:, :, -1].transpose(0, 1).to(v.dtype)
        return k, v

    def advance(self) -> None:
        """The current token is written in every layer: each row holds one position more."""
        self.own_length = [n + 1 for n in self.own_length]
        self._ready = False

    # ------------------------------------------------------------------ taking sequences out

    def sequence(self, row: int) -> BlockSequence:
        """Row `row`'s positions as a held `BlockSequence` (its blocks gain a reference): what a prefix cache keeps."""
        own = self.own[row][:_blocks(self.own_length[row])]
        blocks = self.slot_blocks[self.slot_of[row]] + own
        return BlockSequence(self.pool, blocks, len(self.slot_blocks[self.slot_of[row]]) * BLOCK
                             + self.own_length[row])

    def past(self, row: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Row `row`'s keys and values per layer (1, kv_heads, L, head_dim), as `DecodeState.past` gives them."""
        seq = self.sequence(row)
        try:
            return seq.gather()
        finally:
            seq.release()

    def held_blocks(self) -> set[int]:
        """The blocks the state holds."""
        return {b for blocks in self.slot_blocks for b in blocks} | {b for own in self.own for b in own}

    # ------------------------------------------------------------------ what transformers asks of a cache

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return max((len(self.slot_blocks[s]) * BLOCK + n for s, n in zip(self.slot_of, self.own_length)), default=0)

    def __len__(self) -> int:
        return self.pool.layers
