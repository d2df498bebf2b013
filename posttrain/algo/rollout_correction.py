"""Rollout correction: truncated importance sampling between the policy that sampled (the rollout engine's
log-probs) and the trainer's old policy (`algorithm.rollout_correction.*`, verl's keys).

The two differ when the engine's numerics differ from the trainer's (another dtype, kernels, top-k/top-p
filtering), and when the engine sampled with older weights (asynchronous RL: then the PPO clip against the old
policy times these weights is the decoupled objective, docs/algorithms.md). The weights are detached and multiply
each token's policy loss; they change the measure, not the objective.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .stats import masked_mean

SAFETY_BOUND = 20.0  # log-ratios are clamped to +-20 before exp, as everywhere else
IS_LEVELS = ("token", "sequence")
IS_MODES = ("truncate", "mask")  # min(rho, threshold) | rho, or 0 where rho > threshold


def is_bounds(threshold: float | str) -> tuple[float | None, float]:
    """(lower, upper) of `rollout_is_threshold`: a number is the upper bound alone; a string `lower_upper` (verl's
    IcePop, such as "0.5_4.0") bounds the weights from both sides. ValueError for anything else."""
    if isinstance(threshold, str) and "_" in threshold:
        lower, upper = threshold.split("_", 1)
        return float(lower), float(upper)
    return None, float(threshold)


def rollout_is_weights(old_log_probs: Tensor, rollout_log_probs: Tensor, response_mask: Tensor, *, level: str,
                       threshold: float | str, batch_normalize: bool = False, mode: str = "truncate"
                       ) -> tuple[Tensor, dict[str, float]]:
    """(B, L) weights min(rho, threshold) * m (`truncate`) or rho * [rho <= threshold] * m (`mask`: a token, or with
    `sequence` a whole response, beyond the threshold gets weight 0 but keeps its place in the loss's normaliser),
    rho = pi_old / pi_rollout per token (`token`) or its product over the response (`sequence`, broadcast to the
    tokens); `batch_normalize` rescales them to mean 1 over valid tokens (token) or valid responses (sequence).
    A range threshold `lower_upper` masks, whatever `mode` says: rho * [lower <= rho <= upper] * m (verl's IcePop)."""
    lower, threshold = is_bounds(threshold)
    mode = "mask" if lower is not None else mode
    if level not in IS_LEVELS:
        raise ValueError(f"rollout_is={level!r} is not one of {list(IS_LEVELS)}")
    if mode not in IS_MODES:
        raise ValueError(f"rollout_is_mode={mode!r} is not one of {list(IS_MODES)}")
    m = response_mask.to(old_log_probs.dtype)
    log_ratio = (old_log_probs - rollout_log_probs.to(old_log_probs.dtype)) * m
    if level == "token":
        rho = torch.clamp(log_ratio, -SAFETY_BOUND, SAFETY_BOUND).exp()
    else:
        rho = torch.clamp(log_ratio.sum(-1, keepdim=True), -SAFETY_BOUND, SAFETY_BOUND).exp().expand_as(m)
    rho = rho * m
    metrics = {"rollout_corr/rollout_is_mean": float(masked_mean(rho, m)),
               "rollout_corr/rollout_is_max": float((rho * m).max()) if m.any() else 0.0,
               "rollout_corr/rollout_is_ratio_fraction_high": float(masked_mean((rho > threshold).to(m.dtype), m)),
               "rollout_corr/kl": float(masked_mean(-log_ratio, m))}  # k1 estimate of KL(rollout || old)
    kept = (rho <= threshold) & (rho >= lower) if lower is not None else rho <= threshold
    w = (torch.clamp(rho, max=threshold) if mode == "truncate" else rho * kept).detach()
    if batch_normalize:
        if level == "token":
            mean = masked_mean(w, m)
        else:
            valid = (m.sum(-1) > 0).to(w.dtype)
            mean = (w * m).amax(-1).sum() / valid.sum().clamp(min=1)  # one weight per response
        if float(mean) > 1e-8:
            w = w / mean
        metrics["rollout_corr/rollout_is_batch_norm_factor"] = float(mean) if float(mean) > 1e-8 else 1.0
    return w, metrics


def rollout_probs_diff(old_log_probs: Tensor, rollout_log_probs: Tensor, response_mask: Tensor) -> dict[str, float]:
    """How far the engine's token probabilities are from the trainer's, over the response tokens (verl's
    `training/rollout_probs_diff_*` with `rollout.calculate_log_probs`): max, mean and sample std of
    |exp(logp_old) - exp(logp_rollout)|, and the Pearson correlation of the two probabilities (left out where it is
    undefined: fewer than two tokens, or one side constant). `_valid` is 0 when there is no response token."""
    m = response_mask.bool()
    if not m.any():
        return {"training/rollout_probs_diff_valid": 0.0}
    old = old_log_probs.double()[m].exp()
    rollout = rollout_log_probs.double()[m].exp()
    diff = (old - rollout).abs()
    out = {"training/rollout_probs_diff_valid": 1.0, "training/rollout_probs_diff_max": float(diff.max()),
           "training/rollout_probs_diff_mean": float(diff.mean()),
           "training/rollout_probs_diff_std": float(diff.std()) if diff.numel() > 1 else 0.0}
    if diff.numel() > 1 and float(old.std()) > 0 and float(rollout.std()) > 0:
        out["training/rollout_actor_probs_pearson_corr"] = float(torch.corrcoef(torch.stack([old, rollout]))[0, 1])
    return out
