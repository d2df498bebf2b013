"""Who computes which rows: whole prompt groups split evenly over data-parallel ranks (balanced by tokens when
`trainer.balance_batch`), and micro-batches whose count is the same on every rank (FSDP runs one collective per
forward, so a rank with fewer micro-batches would leave the others waiting).

Pure functions of lists of ints; the roles call them with token counts read off the batch. A token budget
(`use_dynamic_bsz`) bounds the positions the forward computes: a micro-batch's real tokens when it runs packed
(`use_remove_padding`, `token_packs`), else its rows times its padded width (`padded_packs`).
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


def padded_size(rows: list[int], prompt_lens: list[int], response_lens: list[int]) -> int:
    """Positions a forward over these rows computes: each row is padded to the longest prompt and the longest
    response among them (roles/common.trimmed)."""
    if not rows:
        return 0
    return len(rows) * (max(prompt_lens[i] for i in rows) + max(response_lens[i] for i in rows))


def padded_packs(prompt_lens: list[int], response_lens: list[int], max_tokens: int) -> list[list[int]]:
    """The fewest micro-batches, for rows taken longest first, whose padded size (rows x (longest prompt + longest
    response)) is at most `max_tokens`; a row longer than that alone gets a micro-batch of its own. Taking rows by
    length keeps a long row from padding many short ones. Each part lists its rows longest first."""
    order = sorted(range(len(prompt_lens)), key=lambda i: (-(prompt_lens[i] + response_lens[i]), i))
    parts: list[list[int]] = []
    longest_p = longest_r = 0
    for i in order:
        p, r = max(longest_p, prompt_lens[i]), max(longest_r, response_lens[i])
        if not parts or (len(parts[-1]) + 1) * (p + r) > max_tokens:
            parts.append([])
            p, r = prompt_lens[i], response_lens[i]
        parts[-1].append(i)
        longest_p, longest_r = p, r
    return parts


def token_packs(lengths: list[int], max_tokens: int) -> list[list[int]]:
    """Few micro-batches whose real tokens sum to at most `max_tokens` (first fit, longest rows first: a packed
    forward computes real tokens only, so rows of any lengths share one); a row longer than that alone gets a
    micro-batch of its own. Each part lists its rows longest first."""
    parts: list[list[int]] = []
    loads: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda j: (-lengths[j], j)):
        fit = next((k for k, load in enumerate(loads) if load + lengths[i] <= max_tokens), None)
        if fit is None:
            parts.append([])
            loads.append(0)
            fit = len(parts) - 1
        parts[fit].append(i)
        loads[fit] += lengths[i]
    return parts


def split_packs(parts: list[list[int]], count: int, prompt_lens: list[int], response_lens: list[int], *,
                size=None) -> list[list[int]]:
    """`parts` split until there are `count` (another rank needs that many): the largest part — by `size(rows)`,
    default its padded size — is halved, which never makes a part larger; with fewer rows than `count`, the last
    parts are empty (the rank still joins a sharded model's passes). Rows come back in ascending order inside each
    part."""
    size = size or (lambda rows: padded_size(rows, prompt_lens, response_lens))
    parts = [list(p) for p in parts]
    while len(parts) < count:
        splittable = [p for p in parts if len(p) > 1]
        if not splittable:
            parts += [[] for _ in range(count - len(parts))]
            break
        big = max(splittable, key=size)
        at = parts.index(big)
        parts[at:at + 1] = [big[: len(big) // 2], big[len(big) // 2:]]
    return [sorted(p) for p in parts]
