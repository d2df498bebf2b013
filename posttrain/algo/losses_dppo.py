"""DPPO (arXiv 2602.04879): a trust region on the divergence between the old and new probability of the sampled
token, instead of on the ratio. Tokens whose update already moved the probability past the threshold, in the
direction the advantage pushes, are masked out; the rest get -A * sg(min(ratio, clip_ratio_c)) * logp.

As in verl, `clip_ratio_low` / `clip_ratio_high` are the divergence thresholds (not ratio bounds) and
`clip_ratio_c` caps the detached ratio.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .aggregation import AggNorm
from .losses import DEFAULT_SETTINGS, LossSettings, _ratio, finish, register_policy_loss
from .stats import masked_mean


def _dppo(log_prob, old_log_prob, advantages, response_mask, keep: Tensor, s: LossSettings, norm, weights):
    delta, ratio = _ratio(log_prob, old_log_prob)
    keep = keep.detach().to(log_prob.dtype)
    capped = torch.clamp(ratio, max=s.clip_ratio_c).detach()
    loss = -advantages * capped * log_prob * keep
    metrics = {"actor/pg_clipfrac": masked_mean(1.0 - keep, response_mask).detach(),
               "actor/ppo_kl": masked_mean(-delta, response_mask).detach(),
               "actor/pg_clipfrac_lower": masked_mean((ratio > s.clip_ratio_c).to(keep.dtype) * keep,
                                                      response_mask).detach()}
    return finish(loss, response_mask, s.loss_agg_mode, s, norm, weights), metrics


@register_policy_loss("dppo_tv")
def dppo_tv(log_prob, old_log_prob, advantages, response_mask, *, settings: LossSettings = DEFAULT_SETTINGS,
            norm: AggNorm | None = None, rollout_is_weights: Tensor | None = None):
    """Binary total variation p - p_old: kept if <= clip_ratio_high (A > 0) or >= -clip_ratio_low (A <= 0)."""
    diff = log_prob.detach().exp() - old_log_prob.exp()
    keep = torch.where(advantages > 0, diff <= settings.clip_ratio_high, diff >= -settings.clip_ratio_low)
    return _dppo(log_prob, old_log_prob, advantages, response_mask, keep, settings, norm, rollout_is_weights)


@register_policy_loss("dppo_kl")
def dppo_kl(log_prob, old_log_prob, advantages, response_mask, *, settings: LossSettings = DEFAULT_SETTINGS,
            norm: AggNorm | None = None, rollout_is_weights: Tensor | None = None):
    """Binary KL(Bern(p_old) || Bern(p)): kept if <= the threshold or the probability moved against the push."""
    lp, old = log_prob.detach(), old_log_prob
    p, q = lp.exp(), old.exp()
    kl = q * (old - lp) + (1 - q) * torch.log((1 - q + 1e-8) / (1 - p + 1e-8))
    keep = torch.where(advantages > 0, (kl <= settings.clip_ratio_high) | (p <= q),
                       (kl <= settings.clip_ratio_low) | (p >= q))
    return _dppo(log_prob, old_log_prob, advantages, response_mask, keep, settings, norm, rollout_is_weights)
