"""Policy losses (`actor.policy_loss.loss_mode`) and the critic's clipped value loss.

A policy loss is called as
    loss_fn(log_prob, old_log_prob, advantages, response_mask, *, loss_agg_mode, clip_ratio_low,
            clip_ratio_high, clip_ratio_c, norm, const) -> (scalar loss, metrics)
with (B, L) tensors; `norm`/`const` are passed on to `agg_loss` (mini-batch normalisers).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .aggregation import AggNorm, agg_loss
from .registry import Registry
from .stats import masked_mean

POLICY_LOSSES: Registry = Registry("policy loss (actor.policy_loss.loss_mode)")
register_policy_loss = POLICY_LOSSES.register


def get_policy_loss(name: str):
    return POLICY_LOSSES.get(name)


def _ratio(log_prob: Tensor, old_log_prob: Tensor) -> tuple[Tensor, Tensor]:
    delta = torch.clamp(log_prob - old_log_prob, -20.0, 20.0)
    return delta, delta.exp()


@register_policy_loss("vanilla")
def vanilla(log_prob, old_log_prob, advantages, response_mask, *, loss_agg_mode="token-mean",
            clip_ratio_low=0.2, clip_ratio_high=0.2, clip_ratio_c=3.0, norm: AggNorm | None = None, const=None):
    """PPO clipped surrogate with dual-clip (bounded by -A*c for negative advantages)."""
    delta, ratio = _ratio(log_prob, old_log_prob)
    A = advantages
    l1 = -A * ratio
    l2 = -A * torch.clamp(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high)
    lc = torch.maximum(l1, l2)
    l3 = -A * clip_ratio_c
    loss = torch.where(A < 0, torch.minimum(lc, l3), lc)
    m = response_mask
    metrics = {
        "actor/pg_clipfrac": masked_mean((l2 > l1).float(), m).detach(),
        "actor/ppo_kl": masked_mean(-delta, m).detach(),
        "actor/pg_clipfrac_lower": masked_mean(((lc > l3) & (A < 0)).float(), m).detach(),
    }
    return agg_loss(loss, m, loss_agg_mode, norm, const), metrics


@register_policy_loss("gpg")
def gpg(log_prob, old_log_prob, advantages, response_mask, *, loss_agg_mode="token-mean", norm=None, const=None, **_):
    """GPG: plain policy gradient -logp * A, no ratio and no clip."""
    loss = -log_prob * advantages
    metrics = {"actor/ppo_kl": masked_mean(old_log_prob - log_prob, response_mask).detach(),
               "actor/pg_clipfrac": torch.zeros(()), "actor/pg_clipfrac_lower": torch.zeros(())}
    return agg_loss(loss, response_mask, loss_agg_mode, norm, const), metrics


@register_policy_loss("gspo")
def gspo(log_prob, old_log_prob, advantages, response_mask, *, clip_ratio_low=0.2, clip_ratio_high=0.2,
         norm=None, const=None, **_):
    """GSPO: sequence-level ratio (length-normalised) carried by token-level gradients; always seq-mean-token-mean."""
    m = response_mask.to(log_prob.dtype)
    lengths = m.sum(-1).clamp(min=1)
    seq_log_ratio = ((log_prob - old_log_prob) * m).sum(-1) / lengths
    log_s = log_prob - log_prob.detach() + seq_log_ratio.detach().unsqueeze(-1)
    s = torch.exp(torch.clamp(log_s, max=10.0))
    l1 = -advantages * s
    l2 = -advantages * torch.clamp(s, 1 - clip_ratio_low, 1 + clip_ratio_high)
    loss = torch.maximum(l1, l2)
    metrics = {"actor/pg_clipfrac": masked_mean((l2 > l1).float(), m).detach(),
               "actor/ppo_kl": masked_mean(old_log_prob - log_prob, m).detach(),
               "actor/pg_clipfrac_lower": torch.zeros(())}
    return agg_loss(loss, m, "seq-mean-token-mean", norm, const), metrics


@register_policy_loss("cispo")
def cispo(log_prob, old_log_prob, advantages, response_mask, *, loss_agg_mode="token-mean", clip_ratio_low=0.2,
          clip_ratio_high=0.2, norm=None, const=None, **_):
    """CISPO: the clipped ratio is a stop-gradient weight on -A * logp, so every token keeps a gradient."""
    delta, ratio = _ratio(log_prob, old_log_prob)
    clipped = torch.clamp(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high)
    loss = -clipped.detach() * advantages * log_prob
    metrics = {"actor/pg_clipfrac": masked_mean((clipped != ratio).float(), response_mask).detach(),
               "actor/ppo_kl": masked_mean(-delta, response_mask).detach(),
               "actor/pg_clipfrac_lower": torch.zeros(())}
    return agg_loss(loss, response_mask, loss_agg_mode, norm, const), metrics


def value_loss(vpreds: Tensor, old_values: Tensor, returns: Tensor, response_mask: Tensor, *, cliprange_value=0.5,
               loss_agg_mode="token-mean", norm: AggNorm | None = None, const=None) -> tuple[Tensor, dict]:
    """0.5 * agg(max((v - R)^2, (clip(v, v_old +- c) - R)^2)) and the share of tokens where the clip was worse."""
    v_clip = torch.clamp(vpreds, old_values - cliprange_value, old_values + cliprange_value)
    unclipped, clipped = (vpreds - returns) ** 2, (v_clip - returns) ** 2
    loss = 0.5 * agg_loss(torch.maximum(unclipped, clipped), response_mask, loss_agg_mode, norm, const)
    return loss, {"critic/vf_clipfrac": masked_mean((clipped > unclipped).float(), response_mask).detach()}
