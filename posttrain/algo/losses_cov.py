"""Clip-Cov and KL-Cov (Cui et al. 2025, "The Entropy Mechanism of Reinforcement Learning for Reasoning Language
Models", arXiv 2505.22617): entropy collapses through the few tokens whose log-prob and advantage covary most, so
only those tokens are restrained — Clip-Cov drops their gradient, KL-Cov adds a |log-ratio| penalty on them.

The covariance statistics and the number of selected tokens are those of the batch the loss is called on (one
micro-batch in the actor), as in verl: unlike the other losses these two depend on the micro-batch split.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .aggregation import AggNorm
from .losses import DEFAULT_SETTINGS, LossSettings, _ratio, finish, register_policy_loss
from .stats import masked_mean


def token_covariance(advantages: Tensor, log_prob: Tensor, mask: Tensor) -> Tensor:
    """(A - mean A) * (logp - mean logp), means over the valid tokens; detached (it only selects tokens)."""
    a, lp = advantages.detach(), log_prob.detach()
    return (a - masked_mean(a, mask)) * (lp - masked_mean(lp, mask))


@register_policy_loss("clip_cov")
def clip_cov(log_prob, old_log_prob, advantages, response_mask, *, settings: LossSettings = DEFAULT_SETTINGS,
             norm: AggNorm | None = None, rollout_is_weights: Tensor | None = None):
    """PPO clip (no dual clip); among the tokens PPO did not clip whose covariance lies in (clip_cov_lb,
    clip_cov_ub), a random max(int(clip_cov_ratio * tokens), 1) of them lose their gradient (and loss)."""
    s = settings
    delta, ratio = _ratio(log_prob, old_log_prob)
    A, valid = advantages, response_mask > 0
    l1 = -A * ratio
    l2 = -A * torch.clamp(ratio, 1 - s.clip_ratio_low, 1 + s.clip_ratio_high)
    cov = token_covariance(A, log_prob, response_mask)
    candidates = (valid & ~(l2 > l1) & (cov > s.clip_cov_lb) & (cov < s.clip_cov_ub)).nonzero()
    budget = max(int(s.clip_cov_ratio * float(response_mask.sum())), 1)
    chosen = candidates[torch.randperm(len(candidates))[:budget].to(candidates.device)]
    keep = torch.ones_like(ratio)
    keep[chosen[:, 0], chosen[:, 1]] = 0.0
    loss = torch.maximum(l1, l2) * keep
    metrics = {"actor/pg_clipfrac": masked_mean((keep == 0).float(), response_mask).detach(),
               "actor/ppo_kl": masked_mean(-delta, response_mask).detach(),
               "actor/pg_clipfrac_lower": torch.zeros(())}
    return finish(loss, response_mask, s.loss_agg_mode, s, norm, rollout_is_weights), metrics


@register_policy_loss("kl_cov")
def kl_cov(log_prob, old_log_prob, advantages, response_mask, *, settings: LossSettings = DEFAULT_SETTINGS,
           norm: AggNorm | None = None, rollout_is_weights: Tensor | None = None):
    """-A * ratio on every token, plus ppo_kl_coef * |logp - logp_old| on the max(int(kl_cov_ratio * tokens), 1)
    valid tokens of largest covariance."""
    s = settings
    delta, ratio = _ratio(log_prob, old_log_prob)
    loss = -advantages * ratio
    valid = response_mask > 0
    n = int(valid.sum())
    if n:
        cov = token_covariance(advantages, log_prob, response_mask).masked_fill(~valid, float("-inf"))
        top = torch.topk(cov.flatten(), max(1, int(n * s.kl_cov_ratio))).indices
        penalised = torch.zeros(cov.numel(), dtype=loss.dtype, device=loss.device).index_fill_(0, top, 1.0)
        loss = loss + s.ppo_kl_coef * delta.abs() * penalised.view_as(loss)
    metrics = {"actor/pg_clipfrac": torch.zeros(()), "actor/ppo_kl": masked_mean(-delta, response_mask).detach(),
               "actor/pg_clipfrac_lower": torch.zeros(())}
    return finish(loss, response_mask, s.loss_agg_mode, s, norm, rollout_is_weights), metrics
