"""`trainer.watch.*`: the reward-hacking detectors that run beside the loop, their thresholds, and what a firing
one does (docs/reward_hacking.md defines each detector and why its threshold is what it is)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional


@dataclass
class WatchConfig:
    enable: bool = True
    """run the detectors every step and log `watch/<name>` (they read the step's batch and the run's history; a few
    milliseconds a step)"""
    action: str = "warn"
    """what a detector does when it fires (its value reaches its threshold after being below it): `warn` (one line
    naming the detector, the step and example sample ids), `checkpoint` (also save the weights of the step before:
    `global_step_<N-1>`, from which a resume trains step N again), `stop` (save as `checkpoint` does, then end the
    run with exit code 1). Every firing writes its flagged samples to `RUN_DIR/watch/findings.jsonl`"""
    actions: dict = field(default_factory=dict)
    """per-detector actions over `action`, e.g. `{code_fakes: stop, length_drift: checkpoint}`"""
    window: int = 5
    """steps in each window of the trend detectors: the run's first `window` steps are the baseline, the latest
    `window` steps (after those) are compared with it; a trend detector reads 0 until step `window + 1`"""
    min_acc_gain: float = 0.05
    """a trend that comes with this much more correctness (the scorer's `acc`, mean over the same windows) is
    explained by learning and does not fire (length_drift, reward_components, diversity_collapse, copying,
    tool_calls)"""
    samples: int = 4
    """flagged samples written (and sample ids named) per firing"""
    ngram: int = 2
    """word n-grams compared between the responses of one prompt (diversity_collapse)"""
    copy_ngram: int = 3
    """word n-grams of a response looked up in what the policy read (copying); a shorter response is one n-gram"""
    val_window: int = 3
    """validation points compared by val_divergence: the latest and the one `val_window - 1` points before it"""
    kl_window: int = 10
    """steps whose median KL is the typical KL that kl_spike compares a step with"""
    kl_floor: float = 0.01
    """the smallest typical KL kl_spike divides by (a KL near 0 would make any change a spike)"""
    val_divergence: Optional[float] = 0.05
    """fires when both the training reward's rise and validation's fall over the window reach this (absolute score;
    null = off)"""
    length_drift: Optional[float] = 0.5
    """fires when the mean response length moved by this share of its baseline, or the share of responses at the
    length limit moved by this much, with no accuracy gain (null = off)"""
    reward_components: Optional[float] = 0.2
    """fires when a reward component other than correctness rose by this much over its baseline with no accuracy
    gain (components on a 0-1 scale; null = off)"""
    diversity_collapse: Optional[float] = 0.5
    """fires when this share of the baseline's diversity is gone — the n-gram distinctness within groups, or the
    policy's entropy — with no accuracy gain (null = off)"""
    copying: Optional[float] = 0.3
    """fires when the mean share of a response's n-grams found in its prompt or tool results rose by this much over
    its baseline with no accuracy gain (null = off)"""
    tool_calls: Optional[float] = 1.0
    """fires when the mean tool calls per episode rose by this many over the baseline with no accuracy gain (null =
    off)"""
    tool_repeats: Optional[float] = 0.3
    """fires when this share of a step's tool calls repeat an earlier identical call of their episode (null = off)"""
    code_fakes: Optional[float] = 1.0
    """fires when this many of a step's code responses try a known way of faking a pass (null = off)"""
    kl_spike: Optional[float] = 5.0
    """fires when a KL metric of the step (actor/kl_loss, actor/reward_kl_penalty, actor/ppo_kl) reaches this many
    times its typical value (null = off)"""
    rollout_mismatch: Optional[float] = 0.05
    """fires when the KL between the rollout engine's and the trainer's token probabilities (mean over policy
    tokens) reaches this; needs the rollout's log-probs (`rollout.calculate_log_probs`, rollout correction, or
    asynchronous RL; null = off)"""
