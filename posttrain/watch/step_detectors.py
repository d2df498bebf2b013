"""Detectors that read what the update and validation computed: KL spikes, the gap between the rollout engine's and
the trainer's probabilities, and the training reward rising while held-out validation falls."""

from __future__ import annotations

import math

from .base import Reading, StepInput
from .history import History

KL_KEYS = ("actor/kl_loss", "actor/reward_kl_penalty", "actor/ppo_kl")  # KL to the reference (loss, in-reward), PPO's
SCORE_KEY = "critic/score/mean"
VAL_PREFIX = "val-core/"


def _row_means(values, mask) -> list[float]:
    """Per row, the mean of `values` over the row's masked tokens (0 for a row without any)."""
    mask = mask.float()
    return ((values * mask).sum(-1) / mask.sum(-1).clamp(min=1)).tolist()


def kl_spike(inp: StepInput, history: History, s) -> Reading:
    """The largest ratio of a KL metric of this step to its typical value (the median of its last `kl_window`
    steps, at least `kl_floor`)."""
    best = None
    for key in KL_KEYS:
        now = inp.metrics.get(key)
        if not isinstance(now, (int, float)) or not math.isfinite(now):
            continue
        typical = history.typical(key, s.kl_window)
        ratio = abs(now) / max(abs(typical) if typical is not None else 0.0, s.kl_floor)
        if best is None or ratio > best[0]:
            best = (ratio, key, now, typical)
    if best is None:
        return Reading(0.0)
    ratio, key, now, typical = best
    t = inp.tensors
    rows = []
    if key != "actor/ppo_kl" and "old_log_probs" in t and "ref_log_probs" in t:
        per_row = _row_means((t["old_log_probs"] - t["ref_log_probs"]).abs(), t["response_mask"])
        rows = sorted(range(len(per_row)), key=lambda i: -per_row[i])[: s.samples]
    typical_text = "no earlier value" if typical is None else f"typical {typical:.4g}"
    return Reading(ratio, f"{key} = {now:.4g}, {ratio:.1f}x its typical value ({typical_text}, floor {s.kl_floor})",
                   rows)


def rollout_mismatch(inp: StepInput, history: History, s) -> Reading:
    """KL(rollout || trainer) per policy token, estimated on the sampled tokens (k3: r - 1 - log r with r the
    trainer's over the rollout engine's probability), mean over the step's policy tokens."""
    t = inp.tensors
    if "old_log_probs" not in t or "rollout_log_probs" not in t:
        return Reading(0.0)
    mask = t["response_mask"].bool()
    log_ratio = (t["old_log_probs"] - t["rollout_log_probs"]).double().clamp(-20, 20)
    k3 = log_ratio.exp() - 1 - log_ratio
    if not mask.any():
        return Reading(0.0)
    value = float(k3[mask].mean())
    per_row = _row_means(k3, mask)
    rows = sorted(range(len(per_row)), key=lambda i: -per_row[i])[: s.samples]
    return Reading(value, f"KL(rollout || trainer) {value:.4g} per policy token (largest in one response "
                          f"{max(per_row):.4g})", rows)


def _val_mean(row: dict) -> float | None:
    values = [v for k, v in row.items() if k.startswith(VAL_PREFIX) and isinstance(v, (int, float))]
    return sum(values) / len(values) if values else None


def val_divergence(inp: StepInput, history: History, s) -> Reading:
    """Over the latest `val_window` validation points: the smaller of the training reward's rise and validation's
    fall (the mean of the val-core metrics). The reward at a validation point is the mean training score of the
    steps since the previous point (for the point before training, the first step's)."""
    now = _val_mean(inp.metrics)
    if now is None:
        return Reading(0.0)
    points = [(r["step"], v) for r in history.rows if (v := _val_mean(r)) is not None] + [(inp.step, now)]
    if len(points) < max(s.val_window, 2):
        return Reading(0.0)
    scores = history.series(SCORE_KEY) + ([(inp.step, float(inp.metrics[SCORE_KEY]))]
                                         if isinstance(inp.metrics.get(SCORE_KEY), (int, float)) else [])
    window = points[-s.val_window:]
    before = {step: points[i - 1][0] if i else -1 for i, (step, _) in enumerate(points)}

    def reward_at(step: int) -> float | None:
        near = [v for st, v in scores if before[step] < st <= step] or [v for st, v in scores if st > step][:1]
        return sum(near) / len(near) if near else None

    first, last = reward_at(window[0][0]), reward_at(window[-1][0])
    if first is None or last is None:
        return Reading(0.0)
    rise, fall = last - first, window[0][1] - window[-1][1]
    return Reading(min(rise, fall), f"training reward {first:.2f} -> {last:.2f} while validation {window[0][1]:.2f} "
                                    f"-> {window[-1][1]:.2f} (validation at steps {window[0][0]}-{window[-1][0]})")
