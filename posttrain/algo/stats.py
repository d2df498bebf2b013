"""Masked statistics used by every estimator and loss (ALGORITHMS.md, Notation)."""

from __future__ import annotations

import torch
from torch import Tensor


def masked_sum(x: Tensor, mask: Tensor, dim=None) -> Tensor:
    return (x * mask).sum() if dim is None else (x * mask).sum(dim)


def masked_mean(x: Tensor, mask: Tensor, dim=None) -> Tensor:
    """sum(x*m) / (sum(m) + 1e-8): 0 for an all-masked input, never NaN."""
    denom = mask.sum() if dim is None else mask.sum(dim)
    return masked_sum(x, mask, dim) / (denom + 1e-8)


def masked_var(x: Tensor, mask: Tensor) -> Tensor:
    """Unbiased (N-1) variance over the masked entries; 0 when fewer than two entries."""
    n = mask.sum()
    mean = masked_mean(x, mask)
    sq = masked_sum((x - mean) ** 2, mask)
    return torch.where(n > 1, sq / (n - 1).clamp(min=1), torch.zeros_like(sq))


def masked_whiten(x: Tensor, mask: Tensor) -> Tensor:
    """(x - mean) / sqrt(var + 1e-8), statistics pooled over every valid token of the batch."""
    return (x - masked_mean(x, mask)) * torch.rsqrt(masked_var(x, mask) + 1e-8)


def group_ids(index) -> Tensor:
    """Map per-response group keys (uids: strings, ints or a tensor) to dense ids 0..G-1, shape (B,)."""
    if isinstance(index, Tensor):
        return torch.unique(index, return_inverse=True)[1]
    table: dict = {}
    return torch.tensor([table.setdefault(k, len(table)) for k in index], dtype=torch.long)
