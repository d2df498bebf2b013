"""Who computes which rows: whole prompt groups split evenly over data-parallel ranks (balanced by tokens when
`trainer.balance_batch`), and micro-batches whose count is the same on every rank (FSDP runs one collective per
forward, so a rank with fewer micro-batches would leave the others waiting).

Pure functions of lists of ints; the roles call them with token counts read off the batch.
"""

from __future__ import annotations

import heapq


def balanced_parts(weights: list[int], k: int, *, equal_count: bool) -> list[list[int]]:
    """Indices of `weights` in `k` parts with near-equal weight sums (greedy: heaviest first onto the lightest
    part). With `equal_count` every part gets len(weights) // k items (len must divide). Each part is returned in
    ascending index order, so the result is deterministic and keeps the batch's own order inside a part."""
    n = len(weights)
    if k < 1:
        raise ValueError(f"need at least one part, got {k}")
    if equal_count and n % k:
        raise ValueError(f"{n} items cannot be split into {k} parts of equal count")
    cap = n // k if equal_count else n
    parts: list[list[int]] = [[] for _ in range(k)]
    heap = [(0, 0, p) for p in range(k)]  # (load, items, part): lightest first, then fewest items, then lowest
    for i in sorted(range(n), key=lambda j: (-weights[j], j)):
        load, count, p = heapq.heappop(heap)
        parts[p].append(i)
        if count + 1 < cap:  # a full part leaves the heap; with equal counts the heap empties with the items
            heapq.heappush(heap, (load + weights[i], count + 1, p))
    return [sorted(p) for p in parts]


def contiguous_parts(n: int, k: int) -> list[list[int]]:
    """0..n-1 in k consecutive runs (the first n % k runs one longer)."""
    base, extra = divmod(n, k)
    out, start = [], 0
    for p in range(k):
        size = base + (1 if p < extra else 0)
        out.append(list(range(start, start + size)))
        start += size
    return out


def token_budget_count(lengths: list[int], max_tokens: int) -> int:
    """How many micro-batches greedy in-order packing needs so that none holds more than `max_tokens` tokens
    (a single longer row still gets a micro-batch of its own)."""
    count, used = 0, 0
    for n in lengths:
        if count == 0 or (used + n > max_tokens and used > 0):
            count, used = count + 1, 0
        used += n
    return count


def micro_batch_parts(lengths: list[int], count: int) -> list[list[int]]:
    """`count` micro-batches over rows with these token counts, near-equal in tokens (order kept inside each)."""
    if count > len(lengths):
        raise ValueError(f"{len(lengths)} rows cannot fill {count} micro-batches")
    return balanced_parts(lengths, count, equal_count=False)
