"""Estimators that read more than the scores: per-token baselines (optimal_token_baseline) and per-component
group normalisation of a multi-part reward (gdpo). Same calling convention as advantages.py."""

from __future__ import annotations

import torch
from torch import Tensor

from .advantages import _group_stats, _outcome, register_advantage
from .stats import group_ids, masked_whiten


@register_advantage("optimal_token_baseline", uses_groups=True, needs_sum_pi_squared=True)
def optimal_token_baseline(*, token_level_rewards: Tensor, response_mask: Tensor, index=None,
                           values: Tensor | None = None, reward_baselines: Tensor | None = None, gamma: float = 1.0,
                           lam: float = 1.0, norm_adv_by_std_in_grpo: bool = True,
                           old_log_probs: Tensor | None = None, sum_pi_squared: Tensor | None = None,
                           rollout_is_weights: Tensor | None = None, reward_components: Tensor | None = None,
                           reward_weights=None):
    """A per-timestep group baseline B_t = sum_j G_jt W_jt / sum_j W_jt, weighting each response by its path
    variance so far, W_t = sum_{s<=t} (1 - 2 pi_s + sum_v pi_v^2) (times rho_s^2 under rollout correction), the
    variance-minimising baseline of the policy-gradient estimator. A = (G - B) * m, returns G (return-to-go)."""
    if old_log_probs is None or sum_pi_squared is None:
        raise ValueError("optimal_token_baseline needs old_log_probs and sum_pi_squared (the trainer computes both)")
    mask = response_mask.to(token_level_rewards.dtype)
    G = (token_level_rewards * mask).flip(-1).cumsum(-1).flip(-1)
    w = 1 - 2 * old_log_probs.to(G.dtype).exp() + sum_pi_squared.to(G.dtype)
    if rollout_is_weights is not None:
        w = w * rollout_is_weights.to(G.dtype) ** 2
    W = (w * mask).cumsum(-1) * mask
    gid = group_ids(index).to(G.device)
    groups = int(gid.max()) + 1 if gid.numel() else 0
    num = torch.zeros(groups, G.shape[1], dtype=G.dtype, device=G.device).index_add_(0, gid, G * W)
    den = torch.zeros_like(num).index_add_(0, gid, W)
    size = torch.zeros(groups, dtype=G.dtype, device=G.device).index_add_(0, gid, torch.ones_like(G[:, 0]))
    baseline = (num / (den + 1e-8))[gid] * (size[gid] > 1).unsqueeze(-1)  # a group of one has no baseline
    return (G - baseline) * mask, G


@register_advantage("gdpo", uses_groups=True, needs_reward_components=True)
def gdpo(*, token_level_rewards: Tensor, response_mask: Tensor, index=None, values: Tensor | None = None,
         reward_baselines: Tensor | None = None, gamma: float = 1.0, lam: float = 1.0,
         norm_adv_by_std_in_grpo: bool = True, old_log_probs: Tensor | None = None,
         sum_pi_squared: Tensor | None = None, rollout_is_weights: Tensor | None = None,
         reward_components: Tensor | None = None, reward_weights=None):
    """GDPO: each reward component is group-normalised on its own (as GRPO does the total), so a component with a
    large scale cannot drown the others; the weighted sum is then whitened over the batch's valid tokens.
    Without components the total score is the only one."""
    mask = response_mask.to(token_level_rewards.dtype)
    comps = (token_level_rewards.sum(-1, keepdim=True) if reward_components is None
             else reward_components.to(token_level_rewards.dtype))
    weights = torch.ones(comps.shape[1], dtype=comps.dtype) if reward_weights is None else \
        torch.as_tensor(reward_weights, dtype=comps.dtype)
    if weights.numel() != comps.shape[1]:
        raise ValueError(f"gdpo: {weights.numel()} reward weights for {comps.shape[1]} reward components")
    total = torch.zeros_like(comps[:, 0])
    for k in range(comps.shape[1]):
        s = comps[:, k]
        _, _, mean, std = _group_stats(s, index)
        total = total + weights[k] * ((s - mean) / (std + 1e-6) if norm_adv_by_std_in_grpo else s - mean)
    adv, _ = _outcome(total, mask)
    adv = masked_whiten(adv, mask) * mask
    return adv, adv
