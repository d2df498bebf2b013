"""Rollout correction: truncated importance sampling between the policy that sampled (the rollout engine's
log-probs) and the trainer's old policy (`algorithm.rollout_correction.*`, verl's keys).

The two differ when the engine's numerics differ from the trainer's (another dtype, kernels, top-k/top-p
filtering), and when the engine sampled with older weights (asynchronous RL: then the PPO clip against the old
policy times these weights is the decoupled objective, docs/algorithms.md). The weights are detached and multiply
each token's policy loss; they change the measure, not the objective.
"""

from __future__ import annotations

import math

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
        w, metrics["rollout_corr/rollout_is_batch_norm_factor"] = normalised(w, weights_mean(
            weight_sum_and_count(w, m, level), level))
    return w, metrics


def weight_sum_and_count(w: Tensor, m: Tensor, level: str) -> Tensor:
    """(2,) the sum of the weights and their count that `rollout_is_batch_normalize` divides: over the valid tokens
    (`token`), or one weight per valid response (`sequence`). Summed over ranks, the mean over all of them."""
    if level == "token":
        return torch.stack([(w * m).sum(), m.sum()]).double()
    valid = (m.sum(-1) > 0).to(w.dtype)
    return torch.stack([(w * m).amax(-1).sum(), valid.sum()]).double()


def weights_mean(parts: Tensor, level: str) -> float:
    """The mean of `weight_sum_and_count`'s parts (maybe summed over ranks): over tokens as `masked_mean`, over
    responses a plain mean."""
    total, count = (float(x) for x in parts)
    return total / (count + 1e-8) if level == "token" else total / max(count, 1.0)


def normalised(w: Tensor, mean: float) -> tuple[Tensor, float]:
    """The weights divided by their mean (left as they are when the mean is ~0), and the factor used."""
    return (w / mean, mean) if mean > 1e-8 else (w, 1.0)


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


# ---- rejection sampling (`rollout_rs`): masks tokens or whole responses whose divergence is out of bounds
LEGACY_RS = {"token": "token_k1", "sequence": "seq_sum_k1", "geometric": "seq_mean_k1"}  # verl's former levels
RS_OPTIONS = ("token_k1", "token_k2", "token_k3", "seq_sum_k1", "seq_sum_k2", "seq_sum_k3", "seq_mean_k1",
              "seq_mean_k2", "seq_mean_k3", "seq_max_k2", "seq_max_k3")


def rs_bounds(options: str, threshold: float | str) -> list[tuple[str, float | None, float]]:
    """[(option, lower, upper)] of `rollout_rs` (comma-separated options) and `rollout_rs_threshold` (one threshold
    for all, or one per option, comma-separated), as verl parses them: a `k1` option takes a ratio range
    `lower_upper` (a number u alone means 1/u_u); the others one positive upper bound. ValueError otherwise."""
    names = list(dict.fromkeys(o.strip() for o in str(options).split(",") if o.strip()))
    bad = [o for o in names if o not in RS_OPTIONS]
    if not names or bad:
        raise ValueError(f"rollout_rs={options!r}: each option must be one of {list(RS_OPTIONS)}")
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float, str)):
        raise ValueError(f"rollout_rs_threshold={threshold!r} must be a number or a string")
    specs = [s.strip() for s in str(threshold).split(",") if s.strip()]
    if len(specs) not in (1, len(names)):
        raise ValueError(f"rollout_rs_threshold={threshold!r}: give one threshold, or one per option ({len(names)})")
    out = []
    for name, spec in zip(names, specs * len(names) if len(specs) == 1 else specs):
        if name.endswith("k1"):
            lower, upper = (float(x) for x in spec.split("_", 1)) if "_" in spec else (1 / float(spec), float(spec))
            if not 0 < lower <= upper:
                raise ValueError(f"rollout_rs_threshold {spec!r} for {name}: needs 0 < lower <= upper")
        else:
            if "_" in spec:
                raise ValueError(f"rollout_rs_threshold {spec!r} for {name}: one upper bound, not a range")
            lower, upper = None, float(spec)
            if upper <= 0:
                raise ValueError(f"rollout_rs_threshold {spec!r} for {name}: must be positive")
        out.append((name, lower, upper))
    return out


def legacy_rejection(level: str, upper: float, lower: float | None) -> tuple[str, str]:
    """verl's former `rollout_rs=token|sequence|geometric` with the ratio bounds [lower, upper] (`lower` null:
    1 / upper) of the per-token ratio, the response's product of ratios or their geometric mean, as today's option
    and threshold: a ratio in [lower, upper] is a k1 statistic (-log ratio) in [log(1/upper), log(1/lower)]."""
    lower = 1.0 / upper if lower is None else lower
    if not 0 < lower <= upper:
        raise ValueError(f"rollout_rs_threshold_lower={lower} and rollout_rs_threshold={upper}: need 0 < lower <= "
                         "upper")
    return LEGACY_RS[level], f"{1.0 / upper!r}_{1.0 / lower!r}"


def rollout_rejection_mask(old_log_probs: Tensor, rollout_log_probs: Tensor, response_mask: Tensor, *,
                           options: str | None, threshold: float | str | None, veto: float | None = None
                           ) -> tuple[Tensor, dict[str, float]]:
    """(B, L) keep mask (1 kept, 0 rejected, times `response_mask`) and metrics of verl's rejection sampling. With
    r = log(pi_old / pi_rollout) clamped to +-20, the per-token divergences are k1 = -r, k2 = r^2 / 2,
    k3 = e^r - 1 - r; `token_*` judges each token, `seq_sum_*` / `seq_mean_*` / `seq_max_*` the sum / mean / max
    over a response's tokens (the whole response is kept or rejected). A `k1` statistic must lie in
    [log lower, log upper], the others at most upper; a token stays only if every option keeps it. verl then uses
    the mask as the response mask: rejected tokens leave the advantages, the losses and their normalisers.
    `veto` (verl's former `rollout_token_veto_threshold`): a response with any token whose pi_old / pi_rollout is
    below it is rejected whole, with or without `options`."""
    m = response_mask.to(old_log_probs.dtype)
    r = torch.clamp(old_log_probs - rollout_log_probs.to(old_log_probs.dtype), -SAFETY_BOUND, SAFETY_BOUND)
    div = {"k1": -r, "k2": 0.5 * r ** 2, "k3": r.exp() - 1.0 - r}
    valid_seq = m.sum(-1) > 0
    keep = torch.ones_like(m)
    metrics = {}
    if veto is not None:
        log_ratio = old_log_probs - rollout_log_probs.to(old_log_probs.dtype)  # unclamped, as verl's veto
        vetoed = ((log_ratio < math.log(veto)) & m.bool()).any(-1, keepdim=True)
        keep = keep * (~vetoed).to(m.dtype)
        metrics["rollout_corr/rollout_is_veto_fraction"] = (float(vetoed.squeeze(-1)[valid_seq].to(m.dtype).mean())
                                                            if valid_seq.any() else 0.0)
    for name, lower, upper in (rs_bounds(options, threshold) if options is not None else []):
        tok = div[name[-2:]]
        if name.startswith("seq_sum"):
            stat = (tok * m).sum(-1, keepdim=True)
        elif name.startswith("seq_mean"):
            stat = (tok * m).sum(-1, keepdim=True) / (m.sum(-1, keepdim=True) + 1e-8)
        elif name.startswith("seq_max"):
            stat = tok.masked_fill(m == 0, float("-inf")).amax(-1, keepdim=True)
            stat = torch.where(torch.isinf(stat), torch.zeros_like(stat), stat)
        else:
            stat = tok
        lo, hi = (math.log(lower), math.log(upper)) if lower is not None else (None, upper)
        ok = (stat <= hi) & (stat >= lo) if lo is not None else stat <= hi
        ok = ok.expand_as(m).to(m.dtype)
        keep = keep * ok
        p = f"rollout_corr/rollout_rs_{name}"
        per = stat.expand_as(m)
        if name.startswith("token"):
            vals = per[m.bool()]
        else:
            vals = stat.squeeze(-1)[valid_seq]
        metrics |= {f"{p}_mean": float(masked_mean(per, m)), f"{p}_max": float(vals.max()) if vals.numel() else 0.0,
                    f"{p}_min": float(vals.min()) if vals.numel() else 0.0,
                    f"{p}_fraction_high": float((vals > hi).to(m.dtype).mean()) if vals.numel() else 0.0,
                    f"{p}_fraction_low": float((vals < lo).to(m.dtype).mean()) if lo is not None and vals.numel()
                    else 0.0,
                    f"{p}_masked_fraction": float(masked_mean(1 - ok, m)),
                    f"{p}_seq_masked_fraction": float(((1 - ok) * m).amax(-1)[valid_seq].mean()) if valid_seq.any()
                    else 0.0}
    metrics["rollout_corr/rollout_rs_masked_fraction"] = float(masked_mean(1 - keep, m))
    metrics["rollout_corr/rollout_rs_seq_masked_fraction"] = float(((1 - keep) * m).amax(-1).mean()) if m.numel() \
        else 0.0
    return keep * m, metrics
