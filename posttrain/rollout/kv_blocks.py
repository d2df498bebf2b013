"""Keys and values in fixed-size blocks: a pool that sequences take blocks from as they grow and give back when they
end, and the sequences' block lists.

A server's requests come and go at every decoding step, each as long as it turns out to be. Holding each one's keys
and values in blocks of `BLOCK` positions means a sequence holds only the blocks its tokens fill (nothing reserved
for its `max_tokens`, nothing held for the columns of rows that came before it), and sequences that share a prefix
(the `n` samples of a prompt, the turns of one conversation) hold the same blocks: a block has a reference count,
and returns to the free list when its last holder lets it go. A block is written only by a holder that owns it
alone: a shared, partly filled block is copied first (`writable`).

One pool serves every layer: a block id names the same positions in each layer's tensor. A layer's tensor is
(kv_heads, num_blocks, BLOCK, head_dim), kv-head-major: gathering blocks along the block axis gives a
(kv_heads, sequences, positions, head_dim) tensor in one copy (block-major storage would need a second copy to bring
the heads first); a decoding state gathers a row's blocks once, when it joins (paged_state.py).
"""

from __future__ import annotations

import threading

import torch

BLOCK = 16  # positions per block
FIRST_BLOCKS = 64  # blocks at first; the pool doubles when the free list runs out (each growth copies it)


class BlockPool:
    """Per layer keys and values (kv_heads, num_blocks, BLOCK, head_dim), a free list and a reference count per
    block. Thread-safe for taking and letting go of references (a prefix cache may be cleared from another
    thread); writing into blocks is the decoding thread's."""

    def __init__(self, layers: int, kv_heads: int, head_dim: int, *, dtype: torch.dtype, device,
                 first_blocks: int = FIRST_BLOCKS):
        self.layers, self.kv_heads, self.head_dim = layers, kv_heads, head_dim
        self.keys = [torch.zeros(kv_heads, first_blocks, BLOCK, head_dim, dtype=dtype, device=device)
                     for _ in range(layers)]
        self.values = [torch.zeros_like(k) for k in self.keys]
        self.refs = [0] * first_blocks
        self._free = list(range(first_blocks - 1, -1, -1))  # popped from the end: low ids first
        self.grown = 0  # times the pool grew (each copies what it holds)
        self._lock = threading.Lock()

    @classmethod
    def like(cls, keys: torch.Tensor, layers: int, **kw) -> "BlockPool":
        """A pool for keys shaped as `keys` (.., kv_heads, positions, head_dim)."""
        return cls(layers, keys.shape[-3], keys.shape[-1], dtype=keys.dtype, device=keys.device, **kw)

    # ------------------------------------------------------------------ counts

    @property
    def total(self) -> int:
        return len(self.refs)

    @property
    def free(self) -> int:
        return len(self._free)

    @property
    def used(self) -> int:
        return self.total - self.free

    @property
    def shared(self) -> int:
        """Blocks held by more than one holder."""
        return sum(1 for r in self.refs if r > 1)

    def stats(self) -> dict:
        return dict(kv_blocks_used=self.used, kv_blocks_free=self.free, kv_blocks_shared=self.shared,
                    kv_block_size=BLOCK)

    # ------------------------------------------------------------------ references

    def allocate(self, count: int) -> list[int]:
        """`count` blocks, each with one reference (contents undefined)."""
        with self._lock:
            while len(self._free) < count:
                self._grow()
            blocks = [self._free.pop() for _ in range(count)]
            for b in blocks:
                self.refs[b] = 1
            return blocks

    def ref(self, blocks: list[int]) -> None:
        with self._lock:
            for b in blocks:
                if self.refs[b] < 1:
                    raise RuntimeError(f"block {b} is free: it cannot gain a holder")
                self.refs[b] += 1

    def release(self, blocks: list[int]) -> None:
        with self._lock:
            for b in blocks:
                if self.refs[b] < 1:
                    raise RuntimeError(f"block {b} is free already")
                self.refs[b] -= 1
                if self.refs[b] == 0:
                    self._free.append(b)

    def writable(self, block: int) -> int:
        """`block` if its caller holds it alone; else a copy of it (the caller's reference moves to the copy), so that
        the other holders' keys and values stay as they are."""
        with self._lock:
            if self.refs[block] == 1:
                return block
        copy = self.allocate(1)[0]
        for k, v in zip(self.keys, self.values):
            k[:, copy] = k[:, block]
            v[:, copy] = v[:, block]
        self.release([block])
        return copy

    def _grow(self) -> None:
        old = len(self.refs)
        extra = max(1, old)
        pad = lambda t: torch.cat([t, t.new_zeros(t.shape[0], extra, *t.shape[2:])], dim=1)  # noqa: E731
        self.keys = [pad(k) for k in self.keys]
        self.values = [pad(v) for v in self.values]
        self.refs.extend([0] * extra)
        self._free = list(range(old + extra - 1, old - 1, -1)) + self._free
        self.grown += 1

    # ------------------------------------------------------------------ reading

    def gather(self, blocks: list[int], length: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The first `length` positions held by `blocks`, per layer (1, kv_heads, length, head_dim): what an ordinary
        forward over those tokens holds."""
        index = torch.tensor(blocks, dtype=torch.long, device=self.keys[0].device)

        def one(t: torch.Tensor) -> torch.Tensor:
            part = t.index_select(1, index).view(t.shape[0], -1, t.shape[3])
            return part[None, :, :length]
        return [one(k) for k in self.keys], [one(v) for v in self.values]


class BlockSequence:
    """A held sequence of `length` positions: its blocks (one reference each, taken at creation), let go with
    `release`. What the prefix cache keeps of a finished sample."""

    __slots__ = ("pool", "blocks", "length")

    def __init__(self, pool: BlockPool, blocks: list[int], length: int):
        if len(blocks) != -(-length // BLOCK):
            raise ValueError(f"{len(blocks)} blocks for {length} positions")
        self.pool, self.blocks, self.length = pool, list(blocks), length
        pool.ref(self.blocks)

    def prefix(self, length: int) -> "BlockSequence":
        """Its first `length` positions, held anew (the blocks they lie in)."""
        if not 0 < length <= self.length:
            raise ValueError(f"a prefix of {length} positions of a sequence of {self.length}")
        return BlockSequence(self.pool, self.blocks[:-(-length // BLOCK)], length)

    def gather(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        return self.pool.gather(self.blocks, self.length)

    def release(self) -> None:
        if self.blocks:
            self.pool.release(self.blocks)
            self.blocks = []
