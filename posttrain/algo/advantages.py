"""Advantage estimators (`algorithm.adv_estimator`), exactly as ALGORITHMS.md states them.

Every estimator takes one `AdvantageInputs` (the step's tensors and the algorithm's constants) and returns
(advantages, returns), both (B, L); outcome estimators return A_i * m[i, t] for both. One object instead of a
long keyword list: an estimator reads the fields it needs, a misspelt field raises, and `register_advantage`
checks that a new estimator takes exactly `(inputs)`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from torch import Tensor

from .registry import Registry, check_signature
from .stats import group_ids, masked_whiten


@dataclass(frozen=True)
class EstimatorInfo:
    needs_critic: bool = False  # reads `values`
    uses_groups: bool = False  # compares the n responses of one prompt; pointless with rollout.n=1
    needs_greedy_baseline: bool = False  # reads `reward_baselines` (ReMax)
    min_group_size: int = 1
    needs_sum_pi_squared: bool = False  # reads `old_log_probs` and `sum_pi_squared` (optimal_token_baseline)
    needs_reward_components: bool = False  # reads `reward_components` (gdpo)


@dataclass(frozen=True, eq=False)
class AdvantageInputs:
    """What an estimator reads. The trainer fills the optional tensors an estimator's `EstimatorInfo` asks for
    (and those the step has anyway); the constants are `algorithm.*` keys."""

    token_level_rewards: Tensor  # (B, L) float
    response_mask: Tensor  # (B, L) {0,1}
    index: Sequence | None = None  # (B,) group keys (uids): the responses to one prompt share one
    values: Tensor | None = None  # (B, L) critic values (gae)
    reward_baselines: Tensor | None = None  # (B,) greedy responses' scores (remax)
    gamma: float = 1.0
    lam: float = 1.0
    norm_adv_by_std_in_grpo: bool = True
    old_log_probs: Tensor | None = None  # (B, L) (optimal_token_baseline)
    sum_pi_squared: Tensor | None = None  # (B, L) (optimal_token_baseline)
    rollout_is_weights: Tensor | None = None  # (B, L) rollout correction's weights, or None
    reward_components: Tensor | None = None  # (B, K) (gdpo)
    reward_weights: Sequence[float] | None = None  # (K,) (gdpo)


ADVANTAGE_ESTIMATORS: Registry = Registry("advantage estimator (algorithm.adv_estimator)")
ESTIMATOR_INFO: dict[str, EstimatorInfo] = {}


def register_advantage(name: str, *, override: bool = False, **info):
    """Decorator: `@register_advantage("my_est", uses_groups=True)` makes `algorithm.adv_estimator=my_est` work.

    Replacing an existing estimator needs `override=True`, and then its metadata is the one given here."""
    metadata = EstimatorInfo(**info)  # a misspelt field fails here, before anything is registered
    register = ADVANTAGE_ESTIMATORS.register(name, override=override)

    def decorate(fn):
        try:
            check_signature(fn, ("inputs",), (), "advantage estimator")
        except TypeError as e:
            raise TypeError(f"{e}. An estimator takes one AdvantageInputs and reads its fields "
                            "(inputs.token_level_rewards, inputs.response_mask, inputs.index, ...); the keyword form "
                            "of earlier versions is no longer accepted") from None
        register(fn)
        ESTIMATOR_INFO[name] = metadata
        return fn

    return decorate


def get_advantage_estimator(name: str):
    return ADVANTAGE_ESTIMATORS.get(name)


def estimator_info(name: str) -> EstimatorInfo:
    ADVANTAGE_ESTIMATORS.get(name)  # raises the helpful error for unknown names
    return ESTIMATOR_INFO.get(name, EstimatorInfo())


def compute_advantage(name: str, **fields) -> tuple[Tensor, Tensor]:
    """The estimator `name` on `AdvantageInputs(**fields)`: a misspelt field raises TypeError."""
    estimator = get_advantage_estimator(name)
    return estimator(AdvantageInputs(**fields))


# ---------------------------------------------------------------- group statistics


def _group_stats(scores: Tensor, index) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Per-response (group id, group size, group mean, unbiased group std); groups of one get mean 0, std 1."""
    gid = group_ids(index).to(scores.device)
    n_groups = int(gid.max()) + 1 if gid.numel() else 0
    count = torch.zeros(n_groups, dtype=scores.dtype, device=scores.device).index_add_(0, gid, torch.ones_like(scores))
    mean = torch.zeros_like(count).index_add_(0, gid, scores) / count
    sq = torch.zeros_like(count).index_add_(0, gid, (scores - mean[gid]) ** 2)
    std = (sq / (count - 1).clamp(min=1)).sqrt()
    single = count == 1
    mean = torch.where(single, torch.zeros_like(mean), mean)
    std = torch.where(single, torch.ones_like(std), std)
    return gid, count[gid], mean[gid], std[gid]


def _outcome(adv_per_response: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    adv = adv_per_response.unsqueeze(-1) * mask
    return adv, adv


def _scores(rewards: Tensor) -> Tensor:
    return rewards.sum(-1)


# ---------------------------------------------------------------- estimators


@register_advantage("gae", needs_critic=True)
def gae(inputs: AdvantageInputs) -> tuple[Tensor, Tensor]:
    """PPO's GAE over response tokens; masked positions are skipped (they never influence the result)."""
    rewards, values, gamma, lam = inputs.token_level_rewards, inputs.values, inputs.gamma, inputs.lam
    mask = inputs.response_mask.to(values.dtype)
    B, L = values.shape
    next_value = torch.zeros(B, dtype=values.dtype, device=values.device)
    last = torch.zeros_like(next_value)
    adv_raw = torch.zeros_like(values)
    for t in reversed(range(L)):
        m, v = mask[:, t], values[:, t]
        delta = rewards[:, t] + gamma * next_value - v
        cand = delta + gamma * lam * last
        next_value = m * v + (1 - m) * next_value
        last = m * cand + (1 - m) * last
        adv_raw[:, t] = last
    returns = adv_raw + values
    return masked_whiten(adv_raw, mask) * mask, returns


@register_advantage("grpo", uses_groups=True)
def grpo(inputs: AdvantageInputs) -> tuple[Tensor, Tensor]:
    """(s - group mean) / (group std + 1e-6); without the std division this is Dr. GRPO."""
    s = _scores(inputs.token_level_rewards)
    _, _, mean, std = _group_stats(s, inputs.index)
    adv = (s - mean) / (std + 1e-6) if inputs.norm_adv_by_std_in_grpo else s - mean
    return _outcome(adv, inputs.response_mask)


@register_advantage("rloo", uses_groups=True)
def rloo(inputs: AdvantageInputs) -> tuple[Tensor, Tensor]:
    """Leave-one-out baseline: s_i - mean of the other members of the group."""
    s = _scores(inputs.token_level_rewards)
    _, count, mean, _ = _group_stats(s, inputs.index)
    loo = torch.where(count > 1, s - (count * mean - s) / (count - 1).clamp(min=1), s)
    return _outcome(loo, inputs.response_mask)


@register_advantage("reinforce_plus_plus")
def reinforce_plus_plus(inputs: AdvantageInputs) -> tuple[Tensor, Tensor]:
    """Discounted return over the response's own tokens (carried across observation spans), whitened."""
    rewards, gamma = inputs.token_level_rewards, inputs.gamma
    mask = inputs.response_mask.to(rewards.dtype)
    returns = torch.zeros_like(rewards)
    run = torch.zeros_like(rewards[:, 0])
    for t in reversed(range(rewards.shape[1])):
        m = mask[:, t]
        # observation tokens (m = 0) inside a multi-turn response pass the return on to earlier turns unchanged
        run = m * (rewards[:, t] + gamma * run) + (1 - m) * run
        returns[:, t] = m * run
    return masked_whiten(returns, mask) * mask, returns


@register_advantage("reinforce_plus_plus_baseline", uses_groups=True)
def reinforce_plus_plus_baseline(inputs: AdvantageInputs) -> tuple[Tensor, Tensor]:
    """Group-mean baseline, then whitened over every valid token of the batch."""
    mask = inputs.response_mask.to(inputs.token_level_rewards.dtype)
    s = _scores(inputs.token_level_rewards)
    _, _, mean, _ = _group_stats(s, inputs.index)
    adv = masked_whiten((s - mean).unsqueeze(-1) * mask, mask) * mask
    return adv, adv


@register_advantage("remax", needs_greedy_baseline=True)
def remax(inputs: AdvantageInputs) -> tuple[Tensor, Tensor]:
    """Return-to-go minus the score of a greedy response to the same prompt."""
    mask = inputs.response_mask.to(inputs.token_level_rewards.dtype)
    returns = (inputs.token_level_rewards * mask).flip(-1).cumsum(-1).flip(-1)
    adv = returns - inputs.reward_baselines.to(returns.dtype).unsqueeze(-1) * mask
    return adv, returns


@register_advantage("gpg", uses_groups=True)
def gpg(inputs: AdvantageInputs) -> tuple[Tensor, Tensor]:
    """GPG (arXiv 2504.02546): alpha * (s - group mean), alpha = B / max(B - M, 1), M = responses with zero signal.

    Groups of one use mean 0, as in every other group estimator here.
    """
    s = _scores(inputs.token_level_rewards)
    _, _, mean, _ = _group_stats(s, inputs.index)
    centred = s - mean
    B = s.shape[0]
    M = int((centred.abs() < 1e-6).sum())
    alpha = B / max(B - M, 1)
    return _outcome(alpha * centred, inputs.response_mask)


@register_advantage("opo", uses_groups=True)
def opo(inputs: AdvantageInputs) -> tuple[Tensor, Tensor]:
    """Length-weighted group baseline b = sum len_j s_j / sum len_j (groups of one: b = 0)."""
    s = _scores(inputs.token_level_rewards)
    lengths = inputs.response_mask.to(s.dtype).sum(-1)
    gid, count, _, _ = _group_stats(s, inputs.index)
    G = int(gid.max()) + 1
    num = torch.zeros(G, dtype=s.dtype, device=s.device).index_add_(0, gid, lengths * s)
    den = torch.zeros(G, dtype=s.dtype, device=s.device).index_add_(0, gid, lengths)
    base = torch.where(den > 0, num / den.clamp(min=1e-12), torch.zeros_like(num))[gid]
    base = torch.where(count > 1, base, torch.zeros_like(base))
    return _outcome(s - base, inputs.response_mask)


@register_advantage("grpo_passk", uses_groups=True, min_group_size=2)
def grpo_passk(inputs: AdvantageInputs) -> tuple[Tensor, Tensor]:
    """Only the best response of each group (first on ties) gets s_max - s_second (optionally / (std + 1e-6))."""
    s = _scores(inputs.token_level_rewards)
    gid, count, _, std = _group_stats(s, inputs.index)
    if bool((count < 2).any()):
        raise ValueError("grpo_passk needs at least 2 responses per prompt (actor_rollout_ref.rollout.n >= 2)")
    adv = torch.zeros_like(s)
    for g in range(int(gid.max()) + 1):
        members = (gid == g).nonzero().flatten()
        order = torch.argsort(s[members], descending=True, stable=True)
        best, second = members[order[0]], members[order[1]]
        gap = s[best] - s[second]
        adv[best] = gap / (std[best] + 1e-6) if inputs.norm_adv_by_std_in_grpo else gap
    return _outcome(adv, inputs.response_mask)


# the vectorised names verl offers for speed; ours are already vectorised, so they are the same functions
register_advantage("grpo_vectorized", uses_groups=True)(grpo)
register_advantage("rloo_vectorized", uses_groups=True)(rloo)

from . import advantages_more  # noqa: F401  (register optimal_token_baseline, gdpo)
