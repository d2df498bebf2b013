"""Loss aggregation (`loss_agg_mode`) with mini-batch-wide normalisers.

A micro-batch contributes `agg_loss(l, m, mode, norm=mini_batch_norm)`; summing those contributions over the
micro-batches (and ranks) of a mini-batch gives exactly the loss of one pass over the whole mini-batch, so the
accumulated gradient does not depend on how the mini-batch is split.
`token-sum` has no normaliser at all, so it is split-invariant by construction and ignores `norm`/`const`.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

LOSS_AGG_MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


@dataclass(frozen=True)
class AggNorm:
    """Normalisers of one mini-batch (summed over all its micro-batches and ranks)."""

    tokens: float  # T: valid tokens
    seqs: float  # S: responses with at least one valid token
    const: float | None = None  # C for seq-mean-token-sum-norm: loss_scale_factor or data.max_response_length

    def __add__(self, other: "AggNorm") -> "AggNorm":
        return AggNorm(self.tokens + other.tokens, self.seqs + other.seqs, self.const)


def agg_norm(mask: Tensor, const: float | None = None) -> AggNorm:
    """The normalisers of a (mini-)batch mask (B, L)."""
    return AggNorm(float(mask.sum()), float((mask.sum(-1) > 0).sum()), const)


def agg_loss(loss_mat: Tensor, mask: Tensor, mode: str = "token-mean", norm: AggNorm | None = None,
             const: float | None = None) -> Tensor:
    """Aggregate a (B, L) per-token loss to a scalar.

    norm: the mini-batch's normalisers; None means this batch is the whole mini-batch.
    const: C for `seq-mean-token-sum-norm` when `norm` is None (a constant, never the padded length).
    An all-masked mini-batch gives 0, never NaN.
    """
    if mode not in LOSS_AGG_MODES:
        raise ValueError(f"unknown loss_agg_mode '{mode}'; choose one of {list(LOSS_AGG_MODES)}")
    mask = mask.to(loss_mat.dtype)
    if norm is None:
        norm = agg_norm(mask, const)
    masked = loss_mat * mask
    if mode == "token-mean":
        return masked.sum() / max(norm.tokens, 1.0)
    if mode == "token-sum":  # the loss grows with the batch's token count: scale the learning rate to match
        return masked.sum()
    if mode == "seq-mean-token-sum":
        return masked.sum() / max(norm.seqs, 1.0)
    if mode == "seq-mean-token-mean":
        per_seq = masked.sum(-1) / (mask.sum(-1) + 1e-8)
        return per_seq.sum() / max(norm.seqs, 1.0)
    c = norm.const if norm.const is not None else const
    if c is None or c <= 0:
        raise ValueError("seq-mean-token-sum-norm needs a positive constant C "
                         "(actor.loss_scale_factor or data.max_response_length)")
    return masked.sum() / (max(norm.seqs, 1.0) * c)
