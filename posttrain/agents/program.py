"""Agent programs as rollouts: any program that talks to an OpenAI-compatible server plays the episodes, and the
server records the token ids and log-probs of every call it makes (`rollout.agent.program`; docs/agents.md, "Agent
programs over the OpenAI API").

A program is a Python callable `fn(row, base_url, api_key) -> float | None` (given as `module:function` or
`path/to/file.py:function`), run in a thread, or a command line, run as a process with the row as JSON on stdin and
`OPENAI_BASE_URL` / `OPENAI_API_KEY` in its environment. Each sample of a row is one program run with a fresh key,
which is its episode id on the server. Its reward, first found of: the callable's return value / the command's last
stdout line `{"reward": x}`; a `POST /rl/reward`; else none, and the batch's reward manager scores the sample's text
by its data_source like any episode's.

The rules (metrics `agent/program*`):
- the calls of one run become samples by the rule of trajectories.py; all of them carry the run's reward and the
  row's uid, so a row may have more samples than `rollout.n` (GRPO's group statistics then weigh each one);
- a run that made no call gives no sample (`agent/program_no_calls`): no zero reward is invented for it;
- a run that fails — raises, exits non-zero, passes `agent.program_timeout_s`, or returns / prints a reward that is
  not a finite number — gives no sample either (`agent/program_errors/<kind>`; the first of each kind is logged with
  its detail): its calls are dropped, since the failure may be the harness's, not the policy's. A row left with fewer
  samples keeps them; one left with none drops out of the step.
"""

from __future__ import annotations

import contextlib
import json
import math
import numbers
import os
import shlex
import signal
import subprocess
import threading
import time
import uuid
import warnings
from dataclasses import dataclass
from typing import Callable

from ..rollout.base import SamplingParams
from ..tools.targets import is_callable_target, load_callable
from .episode import Episode
from .episode_log import _plain
from .settings import AgentSettings
from .trajectories import trajectories

SERVED_NAME = "policy"  # the model name clients send
COMMAND_GRACE_S = 5.0  # a command is killed at its limit; its thread reports within this much more


@dataclass
class Outcome:
    """How one program run ended: its reward (None: it gave none) or the kind of its failure, with a detail."""

    reward: float | None = None
    error: str | None = None
    detail: str = ""


def _reward(value, where: str) -> Outcome:
    if value is None:
        return Outcome()
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(float(value)):
        return Outcome(error="bad_reward", detail=f"{where} {value!r}, not a finite number")
    return Outcome(reward=float(value))


def printed_reward(stdout: str) -> Outcome:
    """The reward of a command's last non-empty stdout line when it is a JSON object with `reward`; other output
    (logs, a last line that is not such an object) gives no reward."""
    lines = [line for line in stdout.splitlines() if line.strip()]
    if not lines:
        return Outcome()
    try:
        last = json.loads(lines[-1])
    except ValueError:
        return Outcome()
    if not isinstance(last, dict) or "reward" not in last:
        return Outcome()
    return _reward(last["reward"], "printed the reward")


def request_sampling(sampling: SamplingParams):
    """The server's `sampling_override`: the rollout's temperature / top-p / top-k, whatever a client asks for (the
    recorded log-probs are under the distribution training assumes), and max_tokens capped at the response budget."""
    from ..serve.scheduler import RequestSampling

    return RequestSampling(temperature=0.0 if sampling.greedy else sampling.temperature, top_p=sampling.top_p,
                           top_k=sampling.top_k, max_tokens=sampling.max_new_tokens)


@contextlib.contextmanager
def serve_policy(engine, tokenizer, sampling: SamplingParams, programs: int):
    """An OpenAI-compatible server over `engine` for one rollout: (base_url, recorder). It lives for the rollout
    only (started and stopped per call), so it always decodes the weights of the step it serves."""
    from ..serve.app import Served, build_app
    from ..serve.recorder import Recorder
    from ..serve.scheduler import Scheduler
    from ..serve.server import serve_in_thread

    # every program's requests decode together (as the episode loop decodes all of a step's episodes); a request's
    # `n` must fit too
    scheduler = Scheduler(engine, max_running=max(64, programs), max_waiting=max(256, 4 * programs))
    recorder = Recorder()
    scheduler.start()
    try:
        app = build_app(Served(SERVED_NAME, tokenizer, scheduler), recorder=recorder,
                        sampling_override=request_sampling(sampling))
        server = serve_in_thread(app)
        try:
            yield server.base_url, recorder
        finally:
            # requests still in flight (a program past its limit) fail as OpenAI errors before the server goes
            scheduler.close()
            server.close()
    finally:
        scheduler.close()


class ProgramRunner:
    """Runs an agent program per sample against a server over `engine`; `run` has EpisodeRunner's interface.
    `program`: the spec (settings.program by default) or a Python callable. `serve(engine, tokenizer, sampling,
    programs)` is a context manager giving (base_url, recorder) (`serve_policy` by default)."""

    def __init__(self, engine, tokenizer, settings: AgentSettings, program: str | Callable | None = None, *,
                 serve=serve_policy):
        self.engine, self.tokenizer, self.settings, self.serve = engine, tokenizer, settings, serve
        program = settings.program if program is None else program
        if program is None:
            raise ValueError("no agent program: set actor_rollout_ref.rollout.agent.program")
        self.program = program if callable(program) else (
            load_callable(program) if is_callable_target(program) else shlex.split(program))
        self.timeout_s = settings.program_timeout_s
        self.counts: dict[str, float] = {}
        self.logged: set[str] = set()

    def run(self, rows: list[dict], n: int, sampling: SamplingParams) -> list[Episode]:
        """`n` program runs per row; their samples in row order (a row's samples together, possibly none)."""
        jobs = [(row, f"episode-{uuid.uuid4().hex}") for row in rows for _ in range(n)]
        with self.serve(self.engine, self.tokenizer, sampling, len(jobs)) as (base_url, recorder):
            outcomes = self._run_all(jobs, base_url)
            taken = [recorder.take(key) for _, key in jobs]
            for key, value in recorder.counts().items():  # e.g. client seeds dropped (training samples alone)
                self._count(f"agent/server_{key}", value)
        decode = lambda ids: self.tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
        episodes = []
        self._count("agent/programs", len(jobs))
        for (row, _), outcome, (calls, posted) in zip(jobs, outcomes, taken):
            if outcome.error is None and outcome.reward is None and posted is not None:
                outcome = _reward(posted, "posted the reward")
            if outcome.error is not None:
                self._count("agent/program_errors")
                self._count(f"agent/program_errors/{outcome.error}")
                self._log_once(outcome, row)
                continue
            if not calls:
                self._count("agent/program_no_calls")
                continue
            samples = trajectories(calls, sampling.max_new_tokens, row=row, decode=decode)
            for ep in samples:
                ep.reward = outcome.reward
            self._count("agent/program_samples", len(samples))
            self._count("agent/program_scored_by_reward_function", outcome.reward is None)
            episodes += samples
        return episodes

    def take_metrics(self) -> dict[str, float]:
        """The counts since the last call (summed over the runs in between), and forget them."""
        counts, self.counts = self.counts, {}
        return counts

    # ------------------------------------------------------------------ running programs

    def _run_all(self, jobs: list[tuple[dict, str]], base_url: str) -> list[Outcome]:
        """Every job at once, at most `agent.num_workers` running; each has `program_timeout_s` from its start. A
        callable past its limit is abandoned (its thread is a daemon; the server's end fails its requests)."""
        slots = threading.Semaphore(max(1, self.settings.num_workers))
        outcomes: list[Outcome | None] = [None] * len(jobs)
        started: list[float | None] = [None] * len(jobs)
        released = [False] * len(jobs)
        lock, finished = threading.Lock(), threading.Condition()

        def release(i: int) -> None:
            with lock:
                if not released[i]:
                    released[i] = True
                    slots.release()

        def work(i: int, row: dict, key: str) -> None:
            slots.acquire()
            started[i] = time.monotonic()
            result = self._one(row, base_url, key)
            with finished:
                if outcomes[i] is None:
                    outcomes[i] = result
                finished.notify_all()
            release(i)

        for i, (row, key) in enumerate(jobs):
            threading.Thread(target=work, args=(i, row, key), daemon=True, name=f"agent-program-{i}").start()
        limit = self.timeout_s + (0.0 if callable(self.program) else COMMAND_GRACE_S)
        with finished:
            while any(o is None for o in outcomes):
                now = time.monotonic()
                for i, o in enumerate(outcomes):
                    if o is None and started[i] is not None and now - started[i] > limit:
                        outcomes[i] = Outcome(error="timeout", detail=f"ran past program_timeout_s={self.timeout_s:g}")
                        release(i)
                finished.wait(timeout=0.05)
        return outcomes

    def _one(self, row: dict, base_url: str, key: str) -> Outcome:
        if callable(self.program):
            try:
                return _reward(self.program(row, base_url, key), "returned the reward")
            except BaseException as e:  # the program is user code: anything it raises is its own failure
                return Outcome(error="raised", detail=f"{type(e).__name__}: {e}")
        env = {**os.environ, "OPENAI_BASE_URL": base_url, "OPENAI_API_KEY": key}
        try:
            proc = subprocess.Popen(self.program, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, env=env, text=True, start_new_session=True)
        except OSError as e:
            return Outcome(error="raised", detail=f"cannot start {self.program[0]!r}: {e}")
        try:
            out, err = proc.communicate(json.dumps(row, default=_plain), timeout=self.timeout_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)  # the program and whatever it started
            proc.communicate()
            return Outcome(error="timeout", detail=f"killed at program_timeout_s={self.timeout_s:g}")
        if proc.returncode != 0:
            return Outcome(error="exit_status", detail=f"exit status {proc.returncode}; stderr: {err[-500:]!r}")
        return printed_reward(out)

    def _count(self, key: str, value: float = 1.0) -> None:
        self.counts[key] = self.counts.get(key, 0.0) + float(value)

    def _log_once(self, outcome: Outcome, row: dict) -> None:
        if outcome.error in self.logged:
            return
        self.logged.add(outcome.error)
        warnings.warn(f"an agent program failed ({outcome.error}; its sample is dropped, counted in "
                      f"agent/program_errors/{outcome.error}; logged once): {outcome.detail}\n"
                      f"  row: data_source={row.get('data_source')!r} uid={row.get('uid')!r}",
                      RuntimeWarning, stacklevel=2)
