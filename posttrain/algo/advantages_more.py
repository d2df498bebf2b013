"""Estimators that read more than the scores: per-token baselines (optimal_token_baseline and its multi-turn form
tir_optimal_token_baseline) and per-component group normalisation of a multi-part reward (gdpo). Same calling
convention as advantages.py: one `AdvantageInputs` in."""

from __future__ import annotations

import torch
from torch import Tensor

from .advantages import AdvantageInputs, _group_stats, _outcome, register_advantage
from .stats import group_ids, masked_whiten


def _otb_terms(inputs: AdvantageInputs, name: str) -> tuple[Tensor, Tensor, Tensor]:
    """(mask, G, W): the response mask, the return-to-go of r m and the path-variance proxy
    W_t = sum_{s<=t} (1 - 2 pi_s + sum_v pi_v^2) m_s (times rho_s^2 under rollout correction), all (B, L)."""
    if inputs.old_log_probs is None or inputs.sum_pi_squared is None:
        raise ValueError(f"{name} needs old_log_probs and sum_pi_squared (the trainer computes both)")
    mask = inputs.response_mask.to(inputs.token_level_rewards.dtype)
    G = (inputs.token_level_rewards * mask).flip(-1).cumsum(-1).flip(-1)
    w = 1 - 2 * inputs.old_log_probs.to(G.dtype).exp() + inputs.sum_pi_squared.to(G.dtype)
    if inputs.rollout_is_weights is not None:
        w = w * inputs.rollout_is_weights.to(G.dtype) ** 2
    return mask, G, (w * mask).cumsum(-1)


def _zero_tail(baseline: Tensor, members: list[int], lengths: list[int]) -> None:
    """verl's `handle_zero_tail`: where one response of a group is longer than all the others, its baseline is 0
    from the second-longest length on (a baseline from its own return alone would cancel its signal)."""
    order = sorted(lengths[j] for j in members)
    longest = [j for j in members if lengths[j] == order[-1]]
    if len(longest) == 1 and order[-1] > order[-2]:
        baseline[longest[0], order[-2]:] = 0.0


@register_advantage("optimal_token_baseline", uses_groups=True, needs_sum_pi_squared=True)
def optimal_token_baseline(inputs: AdvantageInputs) -> tuple[Tensor, Tensor]:
    """A per-timestep group baseline B_t = sum_j G_jt W_jt / sum_j W_jt, weighting each response by its path
    variance so far (`_otb_terms`), the variance-minimising baseline of the policy-gradient estimator; zero on the
    unmatched tail of a group's one longest response (`_zero_tail`). A = (G - B) * m, returns G (return-to-go)."""
    mask, G, W = _otb_terms(inputs, "optimal_token_baseline")
    W = W * mask
    gid = group_ids(inputs.index).to(G.device)
    groups = int(gid.max()) + 1 if gid.numel() else 0
    num = torch.zeros(groups, G.shape[1], dtype=G.dtype, device=G.device).index_add_(0, gid, G * W)
    den = torch.zeros_like(num).index_add_(0, gid, W)
    size = torch.zeros(groups, dtype=G.dtype, device=G.device).index_add_(0, gid, torch.ones_like(G[:, 0]))
    baseline = (num / (den + 1e-8))[gid] * (size[gid] > 1).unsqueeze(-1)  # a group of one has no baseline
    lengths = mask.sum(-1).long().tolist()  # as verl: a length is a column index (exact for right padding)
    for g in range(groups):
        members = (gid == g).nonzero().flatten().tolist()
        if len(members) > 1:
            _zero_tail(baseline, members, lengths)
    return (G - baseline) * mask, G


@register_advantage("tir_optimal_token_baseline", uses_groups=True, needs_sum_pi_squared=True)
def tir_optimal_token_baseline(inputs: AdvantageInputs) -> tuple[Tensor, Tensor]:
    """The optimal token baseline for multi-turn (tool-integrated) responses: each response's policy tokens are
    taken in order, the observation tokens between them left out, and responses are compared at their k-th policy
    token rather than at a column, so a tool result of another length does not shift the comparison. Per group and
    k: B_k = sum_j G_jk W_jk / (sum_j W_jk + 1e-8) over the members that have a k-th token (responses without policy
    tokens are in no group; a group of one has B = 0), zero on the unmatched tail of a group's one longest response;
    A = (G - B) at each policy token, returns G."""
    mask, G, W = _otb_terms(inputs, "tir_optimal_token_baseline")
    valid = mask.bool()
    lengths = valid.sum(-1).tolist()
    width = max(lengths, default=0)
    compact_G, compact_W = G.new_zeros(len(lengths), width), G.new_zeros(len(lengths), width)
    for i, n in enumerate(lengths):
        compact_G[i, :n], compact_W[i, :n] = G[i, valid[i]], W[i, valid[i]]
    baseline = torch.zeros_like(compact_G)
    groups: dict[int, list[int]] = {}
    for i, g in enumerate(group_ids(inputs.index).tolist()):
        if lengths[i]:
            groups.setdefault(g, []).append(i)
    for members in groups.values():
        if len(members) == 1:
            continue
        rows = torch.tensor(members, device=G.device)
        num, den = (compact_G[rows] * compact_W[rows]).sum(0), compact_W[rows].sum(0) + 1e-8
        baseline[rows] = (num / den).to(baseline.dtype)
        _zero_tail(baseline, members, lengths)
    advantages = torch.zeros_like(G)
    for i, n in enumerate(lengths):
        advantages[i, valid[i]] = compact_G[i, :n] - baseline[i, :n]
    return advantages * mask, G


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
