"""Every detector by name, in the order they run and are shown (docs/reward_hacking.md defines each)."""

from __future__ import annotations

from .base import BATCH, UPDATE, VALIDATION, Detector
from .batch_detectors import (code_fakes, copying, diversity_collapse, length_drift, reward_components, tool_calls,
                              tool_repeats)
from .step_detectors import kl_spike, rollout_mismatch, val_divergence

DETECTORS: dict[str, Detector] = {d.name: d for d in (
    Detector("length_drift", BATCH, length_drift,
             "response length (mean, share at the limit) moving away from the run's start without more accuracy"),
    Detector("reward_components", BATCH, reward_components,
             "a paying reward component (format, shaping) rising without more accuracy"),
    Detector("diversity_collapse", BATCH, diversity_collapse,
             "the responses to one prompt growing alike, or the entropy falling, without more accuracy"),
    Detector("copying", BATCH, copying,
             "responses copying more of their prompt or of tool results without more accuracy"),
    Detector("tool_calls", BATCH, tool_calls, "more tool calls per episode without more accuracy"),
    Detector("tool_repeats", BATCH, tool_repeats, "tool calls that repeat an identical earlier call of the episode"),
    Detector("code_fakes", BATCH, code_fakes, "code responses that try a known way of faking a test pass"),
    Detector("kl_spike", UPDATE, kl_spike, "a KL metric jumping to many times its typical value"),
    Detector("rollout_mismatch", UPDATE, rollout_mismatch,
             "the rollout engine's token probabilities drifting from the trainer's"),
    Detector("val_divergence", VALIDATION, val_divergence, "the training reward rising while held-out validation falls"),
)}
ACTIONS = ("warn", "checkpoint", "stop")  # in rising order: the strongest action of a step's findings is taken


def settings_problems(s) -> list[str]:
    """What is wrong with a `trainer.watch` section (WatchConfig), as messages naming the key."""
    out = []
    if s.action not in ACTIONS:
        out.append(f"trainer.watch.action={s.action!r} is not one of {list(ACTIONS)}")
    if not isinstance(s.actions, dict):
        out.append(f"trainer.watch.actions must map detector names to actions, got {s.actions!r}")
    else:
        for name, action in s.actions.items():
            if name not in DETECTORS:
                out.append(f"trainer.watch.actions: {name!r} is not a detector (detectors: {', '.join(DETECTORS)})")
            elif action not in ACTIONS:
                out.append(f"trainer.watch.actions.{name}={action!r} is not one of {list(ACTIONS)}")
    for key in ("window", "samples", "ngram", "copy_ngram", "kl_window"):
        if not isinstance(getattr(s, key), int) or getattr(s, key) < 1:
            out.append(f"trainer.watch.{key} must be a whole number >= 1, got {getattr(s, key)!r}")
    if not isinstance(s.val_window, int) or s.val_window < 2:
        out.append(f"trainer.watch.val_window must be a whole number >= 2 (it compares two points), got "
                   f"{s.val_window!r}")
    if not s.kl_floor > 0:
        out.append(f"trainer.watch.kl_floor must be > 0, got {s.kl_floor!r}")
    for name in DETECTORS:
        value = getattr(s, name, None)
        if value is not None and not value > 0:
            out.append(f"trainer.watch.{name} (its threshold) must be > 0, or null to turn it off; got {value!r}")
    return out
