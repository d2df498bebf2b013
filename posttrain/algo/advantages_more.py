"""Estimators that read more than the scores: per-token baselines (optimal_token_baseline) and per-component
group normalisation of a multi-part reward (gdpo). Same calling convention as advantages.py: one
`AdvantageInputs` in."""

from __future__ import annotations

import torch
from torch import Tensor

from .advantages import AdvantageInputs, _group_stats, _outcome, register_advantage
from .stats import group_ids, masked_whiten


@register_advantage("optimal_token_baseline", uses_groups=True, needs_sum_pi_squared=True)
def optimal_token_baseline(inputs: AdvantageInputs) -> tuple[Tensor, Tensor]:
    """A per-timestep group baseline B_t = sum_j G_jt W_jt / sum_j W_jt, weighting each response by its path
    variance so far, W_t = sum_{s<=t} (1 - 2 pi_s + sum_v pi_v^2) (times rho_s^2 under rollout correction), the
    variance-minimising baseline of the policy-gradient estimator. A = (G - B) * m, returns G (return-to-go)."""
    if inputs.old_log_probs is None or inputs.sum_pi_squared is None:
        raise ValueError("optimal_token_baseline needs old_log_probs and sum_pi_squared (the trainer computes both)")
    mask = inputs.response_mask.to(inputs.token_level_rewards.dtype)
    G = (inputs.token_level_rewards * mask).flip(-1).cumsum(-1).flip(-1)
    w = 1 - 2 * inputs.old_log_probs.to(G.dtype).exp() + inputs.sum_pi_squared.to(G.dtype)
    if inputs.rollout_is_weights is not None:
        w = w * inputs.rollout_is_weights.to(G.dtype) ** 2
    W = (w * mask).cumsum(-1) * mask
    gid = group_ids(inputs.index).to(G.device)
    groups = int(gid.max()) + 1 if gid.numel() else 0
    num = torch.zeros(groups, G.shape[1], dtype=G.dtype, device=G.device).index_add_(0, gid, G * W)
    den = torch.zeros_like(num).index_add_(0, gid, W)
    size = torch.zeros(groups, dtype=G.dtype, device=G.device).index_add_(0, gid, torch.ones_like(G[:, 0]))
    baseline = (num / (den + 1e-8))[gid] * (size[gid] > 1).unsqueeze(-1)  # a group of one has no baseline
    return (G - baseline) * mask, G


@register_advantage("gdpo", uses_groups=True, needs_reward_components=True)
def gdpo(inputs: AdvantageInputs) -> tuple[Tensor, Tensor]:
    """GDPO: each reward component is group-normalised on its own (as GRPO does the total), so a component with a
    large scale cannot drown the others; the weighted sum is then whitened over the batch's valid tokens.
    Without components the total score is the only one."""
    rewards, reward_weights = inputs.token_level_rewards, inputs.reward_weights
    mask = inputs.response_mask.to(rewards.dtype)
    comps = (rewards.sum(-1, keepdim=True) if inputs.reward_components is None
             else inputs.reward_components.to(rewards.dtype))
    weights = torch.ones(comps.shape[1], dtype=comps.dtype) if reward_weights is None else \
        torch.as_tensor(reward_weights, dtype=comps.dtype)
    if weights.numel() != comps.shape[1]:
        raise ValueError(f"gdpo: {weights.numel()} reward weights for {comps.shape[1]} reward components")
    total = torch.zeros_like(comps[:, 0])
    for k in range(comps.shape[1]):
        s = comps[:, k]
        _, _, mean, std = _group_stats(s, inputs.index)
        total = total + weights[k] * ((s - mean) / (std + 1e-6) if inputs.norm_adv_by_std_in_grpo else s - mean)
    adv, _ = _outcome(total, mask)
    adv = masked_whiten(adv, mask) * mask
    return adv, adv
