"""Advantage estimators (`algorithm.adv_estimator`), exactly as ALGORITHMS.md states them.

Every estimator takes the same keyword-only arguments (`ESTIMATOR_KEYWORDS`), each declared explicitly, so a
misspelt keyword raises TypeError instead of being swallowed; `register_advantage` checks a new one has them:
    token_level_rewards (B, L) float, response_mask (B, L) {0,1}, index (B,) group keys (uids),
    values (B, L) (gae), reward_baselines (B,) (remax), gamma, lam, norm_adv_by_std_in_grpo,
    old_log_probs (B, L) and sum_pi_squared (B, L) (optimal_token_baseline), rollout_is_weights (B, L) or None,
    reward_components (B, K) and reward_weights (K,) or None (gdpo).
It returns (advantages, returns), both (B, L). Outcome estimators return A_i * m[i, t] for both.
"""

from __future__ import annotations

from dataclasses import dataclass

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


ESTIMATOR_KEYWORDS = ("token_level_rewards", "response_mask", "index", "values", "reward_baselines", "gamma", "lam",
                      "norm_adv_by_std_in_grpo", "old_log_probs", "sum_pi_squared", "rollout_is_weights",
                      "reward_components", "reward_weights")


ADVANTAGE_ESTIMATORS: Registry = Registry("advantage estimator (algorithm.adv_estimator)")
ESTIMATOR_INFO: dict[str, EstimatorInfo] = {}


def register_advantage(name: str, *, override: bool = False, **info):
    """Decorator: `@register_advantage("my_est", uses_groups=True)` makes `algorithm.adv_estimator=my_est` work.

    Replacing an existing estimator needs `override=True`, and then its metadata is the one given here."""
    metadata = EstimatorInfo(**info)  # a misspelt field fails here, before anything is registered
    register = ADVANTAGE_ESTIMATORS.register(name, override=override)

    def decorate(fn):
        check_signature(fn, (), ESTIMATOR_KEYWORDS, "advantage estimator")
        register(fn)
        ESTIMATOR_INFO[name] = metadata
        return fn

    return decorate


def get_advantage_estimator(name: str):
    return ADVANTAGE_ESTIMATORS.get(name)


def estimator_info(name: str) -> EstimatorInfo:
    ADVANTAGE_ESTIMATORS.get(name)  # raises the helpful error for unknown names
    return ESTIMATOR_INFO.get(name, EstimatorInfo())


def compute_advantage(name: str, **inputs) -> tuple[Tensor, Tensor]:
    return get_advantage_estimator(name)(**inputs)


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
def gae(*, token_level_rewards: Tensor, response_mask: Tensor, index=None, values: Tensor | None = None,
        reward_baselines: Tensor | None = None, gamma: float = 1.0, lam: float = 1.0, norm_adv_by_std_in_grpo: bool = True,
        old_log_probs: Tensor | None = None, sum_pi_squared: Tensor | None = None,
        rollout_is_weights: Tensor | None = None, reward_components: Tensor | None = None, reward_weights=None):
    """PPO's GAE over response tokens; masked positions are skipped (they never influence the result)."""
    mask = response_mask.to(values.dtype)
    B, L = values.shape
    next_value = torch.zeros(B, dtype=values.dtype, device=values.device)
    last = torch.zeros_like(next_value)
    adv_raw = torch.zeros_like(values)
    for t in reversed(range(L)):
        m, v = mask[:, t], values[:, t]
        delta = token_level_rewards[:, t] + gamma * next_value - v
        cand = delta + gamma * lam * last
        next_value = m * v + (1 - m) * next_value
        last = m * cand + (1 - m) * last
        adv_raw[:, t] = last
    returns = adv_raw + values
    return masked_whiten(adv_raw, mask) * mask, returns


@register_advantage("grpo", uses_groups=True)
def grpo(*, token_level_rewards: Tensor, response_mask: Tensor, index=None, values: Tensor | None = None,
        reward_baselines: Tensor | None = None, gamma: float = 1.0, lam: float = 1.0, norm_adv_by_std_in_grpo: bool = True,
        old_log_probs: Tensor | None = None, sum_pi_squared: Tensor | None = None,
        rollout_is_weights: Tensor | None = None, reward_components: Tensor | None = None, reward_weights=None):
    """(s - group mean) / (group std + 1e-6); without the std division this is Dr. GRPO."""
    s = _scores(token_level_rewards)
    _, _, mean, std = _group_stats(s, index)
    adv = (s - mean) / (std + 1e-6) if norm_adv_by_std_in_grpo else s - mean
    return _outcome(adv, response_mask)


@register_advantage("rloo", uses_groups=True)
def rloo(*, token_level_rewards: Tensor, response_mask: Tensor, index=None, values: Tensor | None = None,
        reward_baselines: Tensor | None = None, gamma: float = 1.0, lam: float = 1.0, norm_adv_by_std_in_grpo: bool = True,
        old_log_probs: Tensor | None = None, sum_pi_squared: Tensor | None = None,
        rollout_is_weights: Tensor | None = None, reward_components: Tensor | None = None, reward_weights=None):
    """Leave-one-out baseline: s_i - mean of the other members of the group."""
    s = _scores(token_level_rewards)
    _, count, mean, _ = _group_stats(s, index)
    loo = torch.where(count > 1, s - (count * mean - s) / (count - 1).clamp(min=1), s)
    return _outcome(loo, response_mask)


@register_advantage("reinforce_plus_plus")
def reinforce_plus_plus(*, token_level_rewards: Tensor, response_mask: Tensor, index=None, values: Tensor | None = None,
        reward_baselines: Tensor | None = None, gamma: float = 1.0, lam: float = 1.0, norm_adv_by_std_in_grpo: bool = True,
        old_log_probs: Tensor | None = None, sum_pi_squared: Tensor | None = None,
        rollout_is_weights: Tensor | None = None, reward_components: Tensor | None = None, reward_weights=None):
    """Discounted return over the response's own tokens (carried across observation spans), whitened."""
    mask = response_mask.to(token_level_rewards.dtype)
    returns = torch.zeros_like(token_level_rewards)
    run = torch.zeros_like(token_level_rewards[:, 0])
    for t in reversed(range(token_level_rewards.shape[1])):
        m = mask[:, t]
        # observation tokens (m = 0) inside a multi-turn response pass the return on to earlier turns unchanged
        run = m * (token_level_rewards[:, t] + gamma * run) + (1 - m) * run
        returns[:, t] = m * run
    return masked_whiten(returns, mask) * mask, returns


@register_advantage("reinforce_plus_plus_baseline", uses_groups=True)
def reinforce_plus_plus_baseline(*, token_level_rewards: Tensor, response_mask: Tensor, index=None, values: Tensor | None = None,
        reward_baselines: Tensor | None = None, gamma: float = 1.0, lam: float = 1.0, norm_adv_by_std_in_grpo: bool = True,
        old_log_probs: Tensor | None = None, sum_pi_squared: Tensor | None = None,
        rollout_is_weights: Tensor | None = None, reward_components: Tensor | None = None, reward_weights=None):
    """Group-mean baseline, then whitened over every valid token of the batch."""
    mask = response_mask.to(token_level_rewards.dtype)
    s = _scores(token_level_rewards)
    _, _, mean, _ = _group_stats(s, index)
    adv = masked_whiten((s - mean).unsqueeze(-1) * mask, mask) * mask
    return adv, adv


@register_advantage("remax", needs_greedy_baseline=True)
def remax(*, token_level_rewards: Tensor, response_mask: Tensor, index=None, values: Tensor | None = None,
        reward_baselines: Tensor | None = None, gamma: float = 1.0, lam: float = 1.0, norm_adv_by_std_in_grpo: bool = True,
        old_log_probs: Tensor | None = None, sum_pi_squared: Tensor | None = None,
        rollout_is_weights: Tensor | None = None, reward_components: Tensor | None = None, reward_weights=None):
    """Return-to-go minus the score of a greedy response to the same prompt."""
    mask = response_mask.to(token_level_rewards.dtype)
    returns = (token_level_rewards * mask).flip(-1).cumsum(-1).flip(-1)
    adv = returns - reward_baselines.to(returns.dtype).unsqueeze(-1) * mask
    return adv, returns


@register_advantage("gpg", uses_groups=True)
def gpg(*, token_level_rewards: Tensor, response_mask: Tensor, index=None, values: Tensor | None = None,
        reward_baselines: Tensor | None = None, gamma: float = 1.0, lam: float = 1.0, norm_adv_by_std_in_grpo: bool = True,
        old_log_probs: Tensor | None = None, sum_pi_squared: Tensor | None = None,
        rollout_is_weights: Tensor | None = None, reward_components: Tensor | None = None, reward_weights=None):
    """GPG (arXiv 2504.02546): alpha * (s - group mean), alpha = B / max(B - M, 1), M = responses with zero signal.

    Groups of one use mean 0, as in every other group estimator here.
    """
    s = _scores(token_level_rewards)
    _, _, mean, _ = _group_stats(s, index)
    centred = s - mean
    B = s.shape[0]
    M = int((centred.abs() < 1e-6).sum())
    alpha = B / max(B - M, 1)
    return _outcome(alpha * centred, response_mask)


@register_advantage("opo", uses_groups=True)
def opo(*, token_level_rewards: Tensor, response_mask: Tensor, index=None, values: Tensor | None = None,
        reward_baselines: Tensor | None = None, gamma: float = 1.0, lam: float = 1.0, norm_adv_by_std_in_grpo: bool = True,
        old_log_probs: Tensor | None = None, sum_pi_squared: Tensor | None = None,
        rollout_is_weights: Tensor | None = None, reward_components: Tensor | None = None, reward_weights=None):
    """Length-weighted group baseline b = sum len_j s_j / sum len_j (groups of one: b = 0)."""
    s = _scores(token_level_rewards)
    lengths = response_mask.to(s.dtype).sum(-1)
    gid, count, _, _ = _group_stats(s, index)
    G = int(gid.max()) + 1
    num = torch.zeros(G, dtype=s.dtype, device=s.device).index_add_(0, gid, lengths * s)
    den = torch.zeros(G, dtype=s.dtype, device=s.device).index_add_(0, gid, lengths)
    base = torch.where(den > 0, num / den.clamp(min=1e-12), torch.zeros_like(num))[gid]
    base = torch.where(count > 1, base, torch.zeros_like(base))
    return _outcome(s - base, response_mask)


@register_advantage("grpo_passk", uses_groups=True, min_group_size=2)
def grpo_passk(*, token_level_rewards: Tensor, response_mask: Tensor, index=None, values: Tensor | None = None,
        reward_baselines: Tensor | None = None, gamma: float = 1.0, lam: float = 1.0, norm_adv_by_std_in_grpo: bool = True,
        old_log_probs: Tensor | None = None, sum_pi_squared: Tensor | None = None,
        rollout_is_weights: Tensor | None = None, reward_components: Tensor | None = None, reward_weights=None):
    """Only the best response of each group (first on ties) gets s_max - s_second (optionally / (std + 1e-6))."""
    s = _scores(token_level_rewards)
    gid, count, _, std = _group_stats(s, index)
    if bool((count < 2).any()):
        raise ValueError("grpo_passk needs at least 2 responses per prompt (actor_rollout_ref.rollout.n >= 2)")
    adv = torch.zeros_like(s)
    for g in range(int(gid.max()) + 1):
        members = (gid == g).nonzero().flatten()
        order = torch.argsort(s[members], descending=True, stable=True)
        best, second = members[order[0]], members[order[1]]
        gap = s[best] - s[second]
        adv[best] = gap / (std[best] + 1e-6) if norm_adv_by_std_in_grpo else gap
    return _outcome(adv, response_mask)


# the vectorised names verl offers for speed; ours are already vectorised, so they are the same functions
register_advantage("grpo_vectorized", uses_groups=True)(grpo)
register_advantage("rloo_vectorized", uses_groups=True)(rloo)

from . import advantages_more  # noqa: F401  (register optimal_token_baseline, gdpo)
