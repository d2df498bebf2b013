"""A decoding state whose keys and values live in blocks (kv_blocks.py): what a server's continuous batching runs on.

The same interface as `decode_state.DecodeState` (the model's layers write into it with `update`, the engine's
`step`, `add` and `keep` drive it, `past` takes a sequence out), a different layout: every row has a block table —
its slot's blocks (the prompt's whole blocks, held once per slot and read once per slot for all its rows, as the
contiguous prefix is), then its own blocks (the prompt's partly filled last block, shared by the prompt's rows until
each first writes into it and copies it, then the tokens it decoded). A row holds the blocks its tokens fill: it
takes a block when its last is full and gives all back when it leaves; nothing is reserved for its `max_new`, and a
row that joins late holds no column of the rows before it. A prompt whose first positions are a kept sequence's
(`add(reused=...)`: the prefix cache's) references that sequence's whole blocks instead of copying them.

The blocks are the keys and values the state holds (what it shares, copies on write, gives back and hands to a
prefix cache); a decoding step reads a working copy of them laid out as the contiguous state's (`prefix_keys`:
per slot its blocks, in a lane of a buffer whose lanes are reused by later slots; `keys`: per row its own
positions), filled from the blocks when a slot or row joins and, at each step, with the positions just written
(read back from the blocks). Gathering every block at every step and layer instead cost a fifth of a decoding
step; the copy holds about what the contiguous state holds (the blocks' saving is in what is kept beyond the
batch: a prefix cache's sequences, shared with the rows resuming them), and prefix_attention.py runs the
contiguous state's products on it.
"""

from __future__ import annotations

import torch

from .kv_blocks import BLOCK, BlockPool, BlockSequence

LANE_GROWTH = 3  # the lanes buffer grows by a third of its lanes (at least one) when no lane is free
WIDTH_GROWTH = 4  # the lanes' width and the rows' own columns grow by a quarter when too narrow


def _blocks(positions: int) -> int:
    return -(-positions // BLOCK)


def _widened(buffer: torch.Tensor | None, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
    """A zero buffer of `shape` holding `buffer` in its first entries (zeros: the masked positions a product still
    reads must be finite)."""
    new = like.new_zeros(shape)
    if buffer is not None:
        new[tuple(slice(0, n) for n in buffer.shape)] = buffer
    return new


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
        self.lane_of: list[int] = []  # per slot: its lane in the working copy's prefix buffers
        self._free_lanes: list[int] = []
        self._lanes: list[torch.Tensor] | None = None  # per layer keys then values (lanes, kv_heads, width, head_dim)
        self.keys: list[torch.Tensor] = []  # per layer (rows, kv_heads, capacity, head_dim): each row's own positions
        self.values: list[torch.Tensor] = []
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
        self._copy_joined(len(self.slot_blocks) - slots, len(self.slot_of) - sum(counts))
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
            self._free_lanes.append(self.lane_of[s])
        renumber = {s: i for i, s in enumerate(read)}
        self.slot_blocks = [self.slot_blocks[s] for s in read]
        self.lane_of = [self.lane_of[s] for s in read]
        if not read:  # nothing left to read: the working copy goes
            self.lane_of, self._free_lanes, self._lanes = [], [], None
        on = keep.to(self.ids.device)
        columns = self.keys[0].shape[2] if self.keys else 0
        need = max((self.own_length[j] for j in kept), default=0) + 1
        if columns > BLOCK and need <= columns - columns // WIDTH_GROWTH:  # the long rows left: fewer own columns
            columns = max(BLOCK, need + need // WIDTH_GROWTH)
        self.keys = [k[:, :, :columns].index_select(0, on) for k in self.keys]
        self.values = [v[:, :, :columns].index_select(0, on) for v in self.values]
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

    def _copy_joined(self, first_slot: int, first_row: int) -> None:
        """The working copy of the slots from `first_slot` on and the rows from `first_row` on (just joined), read
        from their blocks: each slot into a free lane (the buffers grow when none is)."""
        pool = self.pool
        kv, dim, layers = pool.kv_heads, pool.head_dim, pool.layers
        device = pool.keys[0].device
        for _ in range(first_slot, len(self.slot_blocks)):
            self._free_lanes.sort(reverse=True)  # the lowest free lane first: the lanes read stay few
            self.lane_of.append(self._free_lanes.pop() if self._free_lanes else len(self.lane_of))
        lanes = len(self.lane_of) + len(self._free_lanes)
        width = max((len(b) for b in self.slot_blocks[first_slot:]), default=0) * BLOCK
        cap, have = (0, 0) if self._lanes is None else (self._lanes[0].shape[0], self._lanes[0].shape[2])
        if self._lanes is None or lanes > cap or width > have:
            cap = cap if lanes <= cap else (lanes if not cap else max(lanes, cap + max(1, cap // LANE_GROWTH)))
            have = have if width <= have else (width if not have else max(width, have + have // WIDTH_GROWTH))
            old = self._lanes or [None] * (2 * layers)
            self._lanes = [_widened(b, (cap, kv, have, dim), pool.keys[0]) for b in old]
        if width:
            new = self.slot_blocks[first_slot:]
            table = torch.tensor([b + [0] * (width // BLOCK - len(b)) for b in new], dtype=torch.long, device=device)
            at = torch.tensor(self.lane_of[first_slot:], device=device)
            for buffer, t in zip(self._lanes, pool.keys + pool.values):
                gathered = t.index_select(1, table.flatten()).view(kv, len(new), width, dim)
                buffer[at, :, :width] = gathered.transpose(0, 1)
        rows = len(self.own) - first_row
        if not rows and self.keys:
            return
        columns = max(BLOCK, self.keys[0].shape[2] if self.keys else 0)
        table = torch.tensor([o[0] if o else 0 for o in self.own[first_row:]], dtype=torch.long, device=device)
        for buffers, pooled in ((self.keys, pool.keys), (self.values, pool.values)):
            for layer, t in enumerate(pooled):
                joined = t.index_select(1, table).transpose(0, 1)  # (rows, kv, BLOCK, dim): the prompt's partial block
                joined = torch.nn.functional.pad(joined, (0, 0, 0, columns - BLOCK))
                if layer < len(buffers):
                    buffers[layer] = torch.cat([buffers[layer], joined])
                else:
                    buffers.append(joined.contiguous())

    def _prepare(self) -> None:
        """Before a step's first write: each row's block for its next position (a new one when its last is full; a
        copy of its last when that is shared), where each row writes (its block and offset; its column in the
        working copy), and what the attention reads — `prefix_keys` / `prefix_values` (lanes, kv_heads, width,
        head_dim), `rows` (each row's index among lanes x `group`; None while that is the identity) and `bias`
        (rows, 1, 1, width + own columns) float32, -inf on the columns a row does not read."""
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
        self.write_row = torch.arange(len(self.own), device=device)
        self.write_column = torch.tensor(self.own_length, device=device)
        columns = self.keys[0].shape[2]
        if max(self.own_length) >= columns:  # the working copy's own columns grow by a quarter
            columns = max(self.own_length) + 1 + columns // WIDTH_GROWTH
            self.keys = [_widened(k, (*k.shape[:2], columns, k.shape[3]), k) for k in self.keys]
            self.values = [_widened(v, (*v.shape[:2], columns, v.shape[3]), v) for v in self.values]
        lanes = max(self.lane_of) + 1
        layers = self.pool.layers
        self.prefix_keys = [b[:lanes] for b in self._lanes[:layers]]
        self.prefix_values = [b[:lanes] for b in self._lanes[layers:]]
        width = self._lanes[0].shape[2]
        slot_of = torch.tensor(self.slot_of, device=device)
        slot_length = torch.tensor([len(b) * BLOCK for b in self.slot_blocks], device=device)[slot_of]
        shared = torch.arange(width, device=device) >= slot_length[:, None]
        own = torch.arange(columns, device=device) > self.write_column[:, None]  # its write included
        masked = torch.cat([shared, own], dim=1)
        self.bias = torch.zeros(masked.shape, device=device).masked_fill(masked, float("-inf"))[:, None, None]
        within = [0] * len(self.slot_of)
        filled = [0] * len(self.slot_blocks)
        for j, s in enumerate(self.slot_of):
            within[j], filled[s] = filled[s], filled[s] + 1
        lane = torch.tensor(self.lane_of, device=device)[slot_of]
        rows = lane * self.group + torch.tensor(within, device=device)
        identity = len(rows) == lanes * self.group and bool((rows == torch.arange(len(rows), device=device)).all())
        self.rows = None if identity else rows
        self._ready = True

    def buckets(self) -> None:
        """The attention reads the working copy's lanes whole (prefix_buckets.py serves the contiguous state)."""
        return None

    def update(self, key_states, value_states, layer_idx, cache_kwargs=None, kwargs=None):
        """Write each row's current key and value into its block, then into the working copy from the block (a
        write the blocks lost, into a block another row reads, shows in the logits); return the layer's own
        columns (rows, kv_heads, columns, head_dim), which the attention reads beside `prefix_keys`."""
        if not self._ready:
            self._prepare()
        k, v = self.pool.keys[layer_idx], self.pool.values[layer_idx]
        k[:, self.write_block, self.write_offset] = key_states[:, :, -1].transpose(0, 1).to(k.dtype)
        v[:, self.write_block, self.write_offset] = value_states[:, :, -1].transpose(0, 1).to(v.dtype)
        own_k, own_v = self.keys[layer_idx], self.values[layer_idx]
        own_k[self.write_row, :, self.write_column] = k[:, self.write_block, self.write_offset].transpose(0, 1)
        own_v[self.write_row, :, self.write_column] = v[:, self.write_block, self.write_offset].transpose(0, 1)
        return own_k, own_v

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

    @property
    def copy_positions(self) -> int:
        """Positions the working copy holds: lanes x width, rows x own columns (what a step reads, beside the
        blocks)."""
        lanes = 0 if self._lanes is None else self._lanes[0].shape[0] * self._lanes[0].shape[2]
        return lanes + (self.keys[0].shape[0] * self.keys[0].shape[2] if self.keys else 0)

    def held_blocks(self) -> set[int]:
        """The blocks the state holds."""
        return {b for blocks in self.slot_blocks for b in blocks} | {b for own in self.own for b in own}

    # ------------------------------------------------------------------ what transformers asks of a cache

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return max((len(self.slot_blocks[s]) * BLOCK + n for s, n in zip(self.slot_of, self.own_length)), default=0)

    def __len__(self) -> int:
        return self.pool.layers
