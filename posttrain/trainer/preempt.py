"""Stopping on SIGTERM / SIGINT (what Slurm, Kubernetes and Ctrl-C send) without losing the step under way.

The first signal is only noted: the loop finishes its step, writes a checkpoint and stops, and the command exits
with 128 + the signal number after saying how to resume. A second signal exits at once. Every rank of a
multi-process job takes the same decision at the step boundary (a max over all ranks), so a signal that reached one
rank stops them all after the same step. A copy of the same signal that arrives within GRACE_S of the first (a
launcher forwarding Ctrl-C to workers that already got it from the terminal) is not counted as the second.

Before that, while a training command starts (imports, config, model loading, joining the job), there is no step to
finish and nothing to save: a signal ends the process at once with the same exit code, saying so
(`exit_before_first_step`), instead of the signal's silent default.
"""

from __future__ import annotations

import os
import shlex
import signal
import sys
import threading
import time

GRACE_S = 2.0
SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Preempted(Exception):
    """The run stopped on a signal after writing a checkpoint; `exit_code` is 128 + the signal number."""

    def __init__(self, message: str, signum: int):
        super().__init__(message)
        self.exit_code = 128 + signum


class StopOnSignal:
    """Context manager around the training loop: installs the handlers (main thread only) and restores the old
    ones on exit."""

    def __init__(self):
        self.signum: int | None = None
        self._at = 0.0
        self._old: dict = {}

    def __enter__(self) -> "StopOnSignal":
        global _taken_over
        _taken_over = True
        if threading.current_thread() is threading.main_thread():
            for s in SIGNALS:
                self._old[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for s, old in self._old.items():
            signal.signal(s, old)
        self._old.clear()

    def _handle(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        if self.signum is not None:
            if time.monotonic() - self._at < GRACE_S:
                return
            print(f"\n{name} again: exiting now without a checkpoint (the last saved one is kept)", file=sys.stderr,
                  flush=True)
            os._exit(128 + signum)
        self.signum, self._at = signum, time.monotonic()
        if os.environ.get("RANK", "0") == "0":  # every rank notes it; one says so
            print(f"\n{name}: finishing this step, then saving a checkpoint and stopping (send it again to exit at "
                  "once)", file=sys.stderr, flush=True)

    def agreed(self, par) -> int:
        """The signal to stop on, 0 for none: the same on every rank of `par` (a `Parallel`; a collective when
        distributed)."""
        return par.max(int(self.signum or 0), all_ranks=True)


_taken_over = False  # a StopOnSignal has taken the signals over: the start-up handler is no longer the one to act
_default: dict = {}  # the handlers before exit_before_first_step


def exit_before_first_step() -> None:
    """From the first line of a training command's process until a StopOnSignal takes over (fit(), or in a
    multi-process job the moment the process group exists): a signal ends the process at once with 128 + its
    number, saying that no step ran and there is nothing to resume (rank 0 says it). Main thread only."""
    if threading.current_thread() is not threading.main_thread():
        return
    for s in SIGNALS:
        _default[s] = signal.signal(s, _before_first_step)


def _before_first_step(signum, frame) -> None:
    if _taken_over:  # handed back when the loop ended: the signal's usual effect
        signal.signal(signum, _default[signum])
        signal.raise_signal(signum)
        return
    if os.environ.get("RANK", "0") == "0":
        print(f"\n{signal.Signals(signum).name}: stopped before the first step; nothing to resume (no checkpoint was "
              "written)", file=sys.stderr, flush=True)
    os._exit(128 + signum)


def start_up_window() -> None:
    """Crash tests widen the start-up of a training process to POSTTRAIN_STARTUP_PAUSE seconds and learn when it is
    under way (a line on stderr), so that a signal lands in it."""
    pause = float(os.environ.get("POSTTRAIN_STARTUP_PAUSE", "0") or 0)
    if pause > 0:
        print("[start-up under way]", file=sys.stderr, flush=True)
        time.sleep(pause)


def resume_message(signum: int, step: int, checkpoint) -> str:
    command = "posttrain " + shlex.join(sys.argv[1:]) if sys.argv[1:] else "the same command"
    return (f"stopped by {signal.Signals(signum).name} after step {step}; checkpoint written to {checkpoint}.\n"
            f"To resume, run the same command again (trainer.resume_mode=auto, the default, continues from the "
            f"newest checkpoint in its folder):\n  {command}\nor name it: trainer.resume_mode=resume_path "
            f"trainer.resume_from_path={checkpoint}")
