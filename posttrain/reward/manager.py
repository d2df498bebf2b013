"""Batch scoring: decode responses, score them by the reward manager's convention, contain every failure.

`naive` and `dapo` call the scorer once per response, `batch` once for all of a rank's responses (lists in, a list
out), `prime` per response always in worker processes. With `reward_model.num_workers` >= 1 (the default picks a
count from the CPU cores) scorers run in a pool of worker processes (pool.py) with a per-response time limit; with 0
they run in the training process's main thread with no limit. A scorer that raises, hangs, crashes its worker or
returns something that is not a finite number (checks.py) scores 0 and is counted (`reward/errors`,
`reward/timeouts`); the first failure of each kind is logged with its sample, and training goes on. Each rank scores
its own rows with its own pool. An extra key a scorer returns (`pass_rate`, ...) is None on the rows whose scorer
did not return it, so that its metric `reward/<key>/mean` averages the rows that have it.
"""

from __future__ import annotations

import os
import traceback
import warnings
from typing import Callable

import torch

from ..data.batch import Batch, response_attention
from .checks import unpack
from .pool import CRASH, ERROR, OK, TIMEOUT, ScorerPool
from .registry import BatchCall, FileFunction, RegisteredScorers, default_compute_score, require_scorer

MANAGERS = ("naive", "batch", "prime", "dapo", "gdpo")
INVALID = "invalid"


def auto_workers() -> int:
    """Scorer workers when `reward_model.num_workers` is null: the CPU cores this rank may use (the trainer waits
    while they score; the ranks of a node share its cores), at least 2 so that one hung scorer never holds up all
    scoring, at most 8. Two on a 2-core machine; 8 per rank on a GPU node with 8 ranks and 64 or more cores."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    ranks_here = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
    return max(2, min(8, cpus // ranks_here))


def overlong_penalty(length: int, max_len: int, buffer_len: int, penalty_factor: float) -> float:
    """DAPO overlong shaping: 0 up to L_max - L_buf, then linearly down to -penalty_factor."""
    expected = max_len - buffer_len
    if length <= expected:
        return 0.0
    return max(-(length - expected) / buffer_len * penalty_factor, -penalty_factor)


def _call_here(fn, args):
    try:
        return (OK, fn(*args))
    except Exception:  # the scorer is user code: anything it raises is contained
        return (ERROR, traceback.format_exc(limit=4))


def response_texts(tokenizer, batch: Batch) -> list[str]:
    """Each row's whole response decoded without special tokens: every real token after the prompt, the policy's
    and (in a multi-turn episode) the appended tool results and messages, as scorers ported from verl expect."""
    real = response_attention(batch)
    return tokenizer.batch_decode([r[m.bool()].tolist() for r, m in zip(batch["responses"], real)],
                                  skip_special_tokens=True)


def scorer_extra_info(batch: Batch) -> list:
    """The rows' `extra_info`; for multi-turn episodes (meta `episode`) each a copy with the episode's conversation
    added as `messages`, so a scorer can read tool calls and results, and the tools' rewards as `tool_reward`
    (recorded, not added to the reward: a scorer that wants them adds them). The row's own dict is left unchanged."""
    infos = batch.meta["extra_info"]
    episodes = batch.meta.get("episode")
    if episodes is None:
        return infos
    return [info if ep is None else {**(info or {}), "messages": list(ep.messages),
                                     "tool_reward": ep.tool_reward}
            for info, ep in zip(infos, episodes)]


def own_rewards(batch: Batch) -> list:
    """Each row's own reward, which the scorer is not asked for: an agent program's (its episode's `reward`); None
    for the rows the scorer scores."""
    episodes = batch.meta.get("episode") or [None] * len(batch)
    return [getattr(ep, "reward", None) for ep in episodes]


def place_reward(batch: Batch, scores: torch.Tensor, extras: dict[str, list], overlong, log_overlong: bool):
    """token_level_scores (B, L): each row's `scores` plus, for a multi-turn episode, its `env_reward` (the
    environment's rewards, meta `env_reward`), plus DAPO's overlong shaping of the response's length
    (every token after the prompt), on the row's last policy token (the last where response_mask is 1; a row
    without one gets nothing). Adds `env_reward` / `overlong_penalty` to `extras` when they apply."""
    mask = batch["response_mask"]
    scores = scores.to(torch.float32)
    if "env_reward" in batch.meta:
        env = [float(e or 0.0) for e in batch.meta["env_reward"]]
        extras["env_reward"] = env
        scores = scores + torch.tensor(env, dtype=torch.float32)
    if overlong:
        max_len, buf, factor = overlong
        lengths = response_attention(batch).sum(-1).tolist()
        penalties = [overlong_penalty(int(n), max_len, buf, factor) for n in lengths]
        if log_overlong:
            extras["overlong_penalty"] = penalties
        scores = scores + torch.tensor(penalties)
    has_policy = mask.bool().any(-1)
    last = mask.shape[-1] - 1 - mask.bool().flip(-1).int().argmax(-1)  # the last policy token (0 in an empty row)
    last = torch.where(has_policy, last, torch.zeros_like(last))
    token_scores = torch.zeros(mask.shape, dtype=torch.float32)
    token_scores[torch.arange(len(scores)), last] = scores * has_policy
    return token_scores


_WHAT = {ERROR: "raised", CRASH: "crashed its worker process", TIMEOUT: "timed out",
         INVALID: "returned something that is not a reward"}


class RewardManager:
    """`(batch) -> (token_level_scores, extras)`: rule scores of a rank's responses; `close()` stops its workers."""

    def __init__(self, tokenizer, *, compute_score: Callable | None = None, manager: str = "naive",
                 num_workers: int = 0, timeout_s: float = 10.0, overlong: tuple[int, int, float] | None = None,
                 log_overlong: bool = False, experiment_name: str = ""):
        if manager not in MANAGERS:
            raise ValueError(f"reward manager must be one of {MANAGERS}, got {manager!r}")
        if manager == "prime" and num_workers < 1:
            raise ValueError("the prime reward manager scores in worker processes: num_workers must be >= 1")
        self.tokenizer = tokenizer
        self.custom = compute_score  # None: the registered scorers, by data_source
        self.compute_score = compute_score or default_compute_score
        self.manager, self.num_workers, self.timeout_s = manager, num_workers, timeout_s
        self.overlong, self.log_overlong = overlong, log_overlong
        self.experiment_name = experiment_name  # what `gdpo` adds to each row's extra_info, as verl's gdpo manager
        self._pool: ScorerPool | None = None  # workers start at the first call and stay for the next ones
        if num_workers > 0:  # built now so that a scorer that cannot go to a worker fails before training
            self._pool = ScorerPool(BatchCall(compute_score) if manager == "batch"
                                    else compute_score or RegisteredScorers(), num_workers)
        self.logged: set[str] = set()  # failure kinds already logged

    @classmethod
    def from_config(cls, cfg, tokenizer) -> "RewardManager":
        rm = cfg.reward_model
        fn = None
        if cfg.custom_reward_function.path:
            fn = FileFunction(cfg.custom_reward_function.path, cfg.custom_reward_function.name)
        ob = rm.overlong_buffer
        overlong = (cfg.data.max_response_length, ob.len, ob.penalty_factor) if ob.enable else None
        workers = auto_workers() if rm.num_workers is None else rm.num_workers
        return cls(tokenizer, compute_score=fn, manager=rm.reward_manager, num_workers=workers,
                   timeout_s=rm.timeout_s, overlong=overlong, log_overlong=ob.log,
                   experiment_name=cfg.trainer.experiment_name)

    def check_data_sources(self, sources) -> None:
        """Fail before training when a data_source has no scorer (a custom function handles every source)."""
        if self.compute_score is default_compute_score:
            for source in sorted(set(sources)):
                require_scorer(source)

    def __call__(self, batch: Batch) -> tuple[torch.Tensor, dict[str, list]]:
        """token_level_scores (B, L) with each reward on the last policy token (`place_reward`), and per-response
        extras. A scorer reads the whole response (a multi-turn episode's tool results too) and, for an episode,
        its conversation as `extra_info["messages"]`. An agent program's own reward stands for its sample's score:
        the scorer is not called for it."""
        texts = response_texts(self.tokenizer, batch)
        infos = scorer_extra_info(batch)
        if self.manager == "gdpo":  # verl's gdpo manager: the naive call, with the run's name in extra_info
            infos = [{**(info or {}), "experiment_name": self.experiment_name} for info in infos]
        rows = list(zip(batch.meta["data_source"], texts, batch.meta["ground_truth"], infos))
        given = own_rewards(batch)
        scored = [i for i, r in enumerate(given) if r is None]
        outcomes = [(OK, r) for r in given]
        to_score = [rows[i] for i in scored]
        if to_score:
            for i, outcome in zip(scored, self._score_batch(to_score) if self.manager == "batch"
                                  else self._score_rows(to_score)):
                outcomes[i] = outcome
        scores = torch.zeros(len(rows))
        own_acc: dict[int, float] = {}  # rows whose scorer reported its own `acc` (partial credit is not success)
        extras: dict[str, list] = {"errors": [0.0] * len(rows), "timeouts": [0.0] * len(rows)}
        for i, (status, value) in enumerate(outcomes):
            if status == OK:
                score, more, problem = unpack(value)
                if problem is not None:
                    status, value = INVALID, problem
            if status != OK:
                extras["timeouts" if status == TIMEOUT else "errors"][i] = 1.0
                self._log_once(status, value, rows[i])
                continue
            for key, v in more.items():
                if key == "acc":
                    own_acc[i] = v
                else:
                    extras.setdefault(key, [None] * len(rows))[i] = v  # None: this row's scorer gave no such key
            scores[i] = score
        extras["acc"] = [own_acc.get(i, float(s > 0)) for i, s in enumerate(scores.tolist())]
        extras["score"] = scores.tolist()  # the task's own score: what place_reward adds is training reward only
        extras["response_text"] = texts
        return place_reward(batch, scores, extras, self.overlong, self.log_overlong), extras

    def _log_once(self, status: str, detail, row) -> None:
        """The first failure of each kind, with its sample; later ones are only counted."""
        if status in self.logged:
            return
        self.logged.add(status)
        data_source, text, truth, _ = row
        what = {TIMEOUT: f"took longer than reward_model.timeout_s={self.timeout_s:g}"}.get(status, detail)
        warnings.warn(f"the reward function {_WHAT[status]} (scored 0, counted in reward/"
                      f"{'timeouts' if status == TIMEOUT else 'errors'}; logged once): {what}\n"
                      f"  sample: data_source={data_source!r} ground_truth={truth!r} response={text[:300]!r}",
                      RuntimeWarning, stacklevel=3)

    # ---------------------------------------------------------------- execution

    def _score_rows(self, rows):
        if self.num_workers <= 0:
            return [_call_here(self.compute_score, row) for row in rows]
        return self._pool.map(rows, self.timeout_s)

    def _score_batch(self, rows):
        """One call for all rows (limit: timeout_s per row); a wrong-length answer fails every row."""
        if not rows:
            return []
        job = tuple(map(list, zip(*rows)))
        if self.num_workers <= 0:
            status, value = _call_here(BatchCall(self.custom), job)
        else:
            [(status, value)] = self._pool.map([job], self.timeout_s * len(rows))
        if status != OK:
            return [(status, value)] * len(rows)
        sized = hasattr(value, "__len__") and not isinstance(value, (str, bytes, dict))  # list, tuple, array
        if not sized or len(value) != len(rows):
            size = f"{len(value)} values" if sized else f"a {type(value).__name__}"
            return [(INVALID, f"the batch reward function returned {size} for {len(rows)} responses")] * len(rows)
        return [(OK, v) for v in list(value)]

    def start(self) -> None:
        """Start the worker processes now rather than at the first call (they start up in the background)."""
        if self._pool is not None:
            self._pool.start()

    def close(self) -> None:
        """Stop the worker processes (a later call starts new ones)."""
        if self._pool is not None:
            self._pool.close()
