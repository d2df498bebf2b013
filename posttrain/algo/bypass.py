"""Rollout correction's bypass mode in the policy loss (`algorithm.rollout_correction.bypass_mode=True`, verl's).

The rollout's log-probs stand for the old policy's (no old-log-prob pass), and what verl judges against the current
policy happens here, at each micro-batch, with pi = the current policy (detached where it is a weight or a test):

- rejection sampling (`rollout_rs`) and the token veto (`rollout_token_veto_threshold`): the rejected tokens leave
  the policy loss but stay in its normaliser (the entropy and KL terms keep them);
- `loss_type=ppo_clip`: the configured policy loss on ratio pi / pi_rollout, no importance weights (the ratio is the
  correction; verl computes the weights for its metrics only);
- `loss_type=reinforce`: REINFORCE with explicit weights, `agg(-A * logp * w)` with w = sg(pi / pi_rollout) per token
  or per response (`rollout_is`), truncated at `rollout_is_threshold` (or masked outside a range lower_upper), no
  clip; without `rollout_is`, plain `agg(-A * logp)`. With `rollout_is_batch_normalize`, w is divided by its mean over
  the micro-batch's valid tokens (or responses) on every data-parallel rank, as verl normalises in its loss: that
  mean, and so the loss, depends on how the mini-batch is split into micro-batches.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

from .aggregation import AggNorm, agg_loss
from .losses import LossSettings
from .rollout_correction import (normalised, rollout_is_weights, rollout_rejection_mask, weight_sum_and_count,
                                 weights_mean)
from .stats import masked_mean

LOSS_TYPES = ("ppo_clip", "reinforce")


@dataclass(frozen=True)
class BypassSettings:
    """`algorithm.rollout_correction.*` as bypass mode's loss reads them."""

    loss_type: str = "ppo_clip"
    rollout_is: str | None = None
    rollout_is_threshold: float | str = 2.0
    rollout_is_mode: str = "truncate"
    rollout_is_batch_normalize: bool = False
    rollout_rs: str | None = None
    rollout_rs_threshold: float | str | None = None
    veto: float | None = None

    @classmethod
    def of(cls, rc) -> "BypassSettings | None":
        """From a rollout_correction config: None outside bypass mode, or when the configured loss runs as it is."""
        veto = getattr(rc, "rollout_token_veto_threshold", None)
        if not rc.bypass_mode or (rc.loss_type == "ppo_clip" and rc.rollout_rs is None and veto is None):
            return None
        return cls(rc.loss_type, rc.rollout_is, rc.rollout_is_threshold, rc.rollout_is_mode,
                   rc.rollout_is_batch_normalize, rc.rollout_rs, rc.rollout_rs_threshold, veto)


def reinforce_loss(log_prob: Tensor, rollout_log_prob: Tensor, advantages: Tensor, response_mask: Tensor, *,
                   settings: LossSettings, norm: AggNorm | None, weights: Tensor | None) -> tuple[Tensor, dict]:
    """`agg(-A * logp * w)` (w = 1 without weights) and verl's `actor/ppo_kl` = mean(logp_rollout - logp)."""
    loss = -advantages * log_prob if weights is None else -advantages * log_prob * weights
    zero = torch.zeros(())
    return agg_loss(loss, response_mask, settings.loss_agg_mode, norm, settings.const), {
        "actor/ppo_kl": masked_mean(rollout_log_prob - log_prob.detach(), response_mask),
        "actor/pg_clipfrac": zero, "actor/pg_clipfrac_lower": zero}


def bypass_loss(policy_loss, log_prob: Tensor, rollout_log_prob: Tensor, advantages: Tensor, response_mask: Tensor,
                *, bypass: BypassSettings, settings: LossSettings, norm: AggNorm | None,
                sum_over_ranks: Callable[[Tensor], Tensor] = lambda x: x) -> tuple[Tensor, dict]:
    """One micro-batch's policy loss in bypass mode (see the module docstring). `sum_over_ranks` sums a small tensor
    over the data-parallel ranks (batch normalisation of the weights)."""
    current = log_prob.detach()
    mask, metrics = response_mask, {}
    if bypass.rollout_rs is not None or bypass.veto is not None:
        mask, metrics = rollout_rejection_mask(current, rollout_log_prob, response_mask, options=bypass.rollout_rs,
                                               threshold=bypass.rollout_rs_threshold, veto=bypass.veto)
    if bypass.loss_type == "ppo_clip":
        loss, loss_metrics = policy_loss(log_prob, rollout_log_prob, advantages, mask, settings=settings, norm=norm,
                                         rollout_is_weights=None)
        return loss, loss_metrics | metrics
    if bypass.loss_type != "reinforce":
        raise ValueError(f"rollout_correction.loss_type={bypass.loss_type!r} is not one of {list(LOSS_TYPES)}")
    weights = None
    if bypass.rollout_is is not None:
        weights, is_metrics = rollout_is_weights(current, rollout_log_prob, response_mask.to(current.dtype),
                                                 level=bypass.rollout_is, threshold=bypass.rollout_is_threshold,
                                                 mode=bypass.rollout_is_mode)
        metrics |= is_metrics
        if bypass.rollout_is_batch_normalize:
            parts = sum_over_ranks(weight_sum_and_count(weights, response_mask.to(weights.dtype), bypass.rollout_is))
            weights, factor = normalised(weights, weights_mean(parts, bypass.rollout_is))
            metrics["rollout_corr/rollout_is_batch_norm_factor"] = factor
    loss, loss_metrics = reinforce_loss(log_prob, rollout_log_prob, advantages, mask, settings=settings, norm=norm,
                                        weights=weights)
    return loss, loss_metrics | metrics
