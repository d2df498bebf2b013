"""Reward-hacking detectors that run beside the training loop (docs/reward_hacking.md).

Each detector is a pure function of the step (its scored batch, read once into a `StepView`, or the metrics the
update and validation computed) and the run's history (`History`: the metrics of the steps before), returning a
`Reading` logged as `watch/<name>`. `Watch` runs them at their phase of the step, keeps the history and turns a
reading that reaches its threshold into a `Finding`; the trainer acts on findings (warn / checkpoint / stop)."""

from .base import Reading, StepInput
from .history import History
from .registry import ACTIONS, DETECTORS, settings_problems
from .view import Sample, StepView, step_view
from .watcher import Finding, Watch, WatchStopped

__all__ = ["ACTIONS", "DETECTORS", "Finding", "History", "Reading", "Sample", "StepInput", "StepView", "Watch",
           "WatchStopped", "settings_problems", "step_view"]
