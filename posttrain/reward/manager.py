"""Batch scoring: decode responses, call the scorer per response, contain scorers that raise or hang.

Scorers run in the main thread (math-verify's timeouts use signal.alarm, which only works there) or, with
`reward_model.num_workers > 0`, in worker processes with a per-response time limit; a hung worker is replaced.
A scorer that raises or times out scores 0 and is counted (`reward/errors`, `reward/timeouts`); training goes on.
"""

from __future__ import annotations

import multiprocessing as mp
import traceback
import warnings
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from concurrent.futures.process import BrokenProcessPool
from typing import Callable

import torch

from ..data.batch import Batch
from .registry import _unknown, default_compute_score, known_data_sources, load_custom_reward_function


def overlong_penalty(length: int, max_len: int, buffer_len: int, penalty_factor: float) -> float:
    """DAPO overlong shaping: 0 up to L_max - L_buf, then linearly down to -penalty_factor."""
    expected = max_len - buffer_len
    if length <= expected:
        return 0.0
    return max(-(length - expected) / buffer_len * penalty_factor, -penalty_factor)


def _call(fn, args):
    try:
        return ("ok", fn(*args))
    except Exception:  # the scorer is user code: anything it raises is contained
        return ("error", traceback.format_exc(limit=3))


class RewardManager:
    def __init__(self, tokenizer, *, compute_score: Callable | None = None, num_workers: int = 0,
                 timeout_s: float = 10.0, overlong: tuple[int, int, float] | None = None, log_overlong: bool = False):
        self.tokenizer = tokenizer
        self.compute_score = compute_score or default_compute_score
        self.num_workers, self.timeout_s, self.overlong, self.log_overlong = num_workers, timeout_s, overlong, log_overlong
        self._pool: ProcessPoolExecutor | None = None
        self.warned = 0

    @classmethod
    def from_config(cls, cfg, tokenizer) -> "RewardManager":
        fn = None
        if cfg.custom_reward_function.path:
            fn = load_custom_reward_function(cfg.custom_reward_function.path, cfg.custom_reward_function.name)
        ob = cfg.reward_model.overlong_buffer
        overlong = (cfg.data.max_response_length, ob.len, ob.penalty_factor) if ob.enable else None
        return cls(tokenizer, compute_score=fn, num_workers=cfg.reward_model.num_workers,
                   timeout_s=cfg.reward_model.timeout_s, overlong=overlong, log_overlong=ob.log)

    def check_data_sources(self, sources) -> None:
        """Fail before training when a data_source has no scorer (a custom function handles every source)."""
        if self.compute_score is default_compute_score:
            known = set(known_data_sources())
            for source in sorted(set(sources)):
                if source not in known:
                    raise _unknown(source)

    def __call__(self, batch: Batch) -> tuple[torch.Tensor, dict[str, list]]:
        """token_level_scores (B, L) with each score on the last real response token, and per-response extras."""
        responses, mask = batch["responses"], batch["response_mask"]
        texts = self.tokenizer.batch_decode([r[m.bool()].tolist() for r, m in zip(responses, mask)],
                                            skip_special_tokens=True)
        jobs = [(ds, text, gt, extra) for ds, text, gt, extra in
                zip(batch.meta["data_source"], texts, batch.meta["ground_truth"], batch.meta["extra_info"])]
        results = self._run_all(jobs)
        scores = torch.zeros(len(jobs))
        own_acc: dict[int, float] = {}  # rows whose scorer reported its own `acc` (partial credit is not success)
        extras: dict[str, list] = {"errors": [], "timeouts": []}
        for i, (status, value) in enumerate(results):
            extras["errors"].append(float(status == "error"))
            extras["timeouts"].append(float(status == "timeout"))
            if status == "error" and self.warned < 3:
                self.warned += 1
                warnings.warn(f"reward function raised (scored 0, training goes on):\n{value}")
            if status != "ok":
                continue
            if isinstance(value, dict):
                if "score" not in value:
                    raise ValueError(f"a reward function returned a dict without 'score': {value}")
                for key, v in value.items():
                    if key == "acc" and isinstance(v, (int, float, bool)):
                        own_acc[i] = float(v)
                    elif key != "score" and isinstance(v, (int, float, bool)):
                        extras.setdefault(key, [0.0] * len(jobs))[i] = float(v)
                value = value["score"]
            scores[i] = float(value)
        extras["acc"] = [own_acc.get(i, float(s > 0)) for i, s in enumerate(scores.tolist())]
        extras["score"] = scores.tolist()  # the task's own score; shaping below changes only the training reward
        if self.overlong:
            max_len, buf, factor = self.overlong
            lengths = mask.sum(-1).tolist()
            penalties = [overlong_penalty(int(n), max_len, buf, factor) for n in lengths]
            if self.log_overlong:
                extras["overlong_penalty"] = penalties
            scores = scores + torch.tensor(penalties)
        extras["response_text"] = texts
        token_scores = torch.zeros(mask.shape, dtype=torch.float32)
        last = (mask.sum(-1) - 1).clamp(min=0)
        token_scores[torch.arange(len(jobs)), last] = scores * (mask.sum(-1) > 0)
        return token_scores, extras

    # ---------------------------------------------------------------- execution

    def _run_all(self, jobs):
        if self.num_workers <= 0:
            return [_call(self.compute_score, job) for job in jobs]
        results = [None] * len(jobs)
        pending = list(range(len(jobs)))
        while pending:
            pool = self._get_pool()
            futures = {i: pool.submit(_call, self.compute_score, jobs[i]) for i in pending}
            pending = []
            broken = False
            for i, fut in futures.items():
                if broken:
                    pending.append(i)
                    continue
                try:
                    results[i] = fut.result(timeout=self.timeout_s)
                except FutureTimeout:
                    results[i] = ("timeout", None)
                    broken = True  # the worker is stuck: replace the pool, re-run what had not finished
                    self._kill_pool()
                except BrokenProcessPool:
                    results[i] = ("error", "scorer worker died")
                    broken = True
                    self._kill_pool()
        return results

    def _get_pool(self) -> ProcessPoolExecutor:
        if self._pool is None:
            self._pool = ProcessPoolExecutor(self.num_workers, mp_context=mp.get_context("fork"))
        return self._pool

    def _kill_pool(self) -> None:
        if self._pool is not None:
            for proc in list(getattr(self._pool, "_processes", {}).values()):
                proc.kill()
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None

    def close(self) -> None:
        self._kill_pool()
