"""Asynchronous RL with two groups of processes (`rollout.n_gpus_per_node` > 0): rank 0 trains, rank 1 generates
and scores, and generation may run `async_training.staleness_threshold` batches ahead of training.

The exchange, for steps k = first..last and lag L (the threshold):

    generator: generate batch k with its weights (version v) -> send it -> if `expects_weights(k)`: receive weights
    trainer:   receive batch k -> if L >= 1 and `expects_weights(k)`: push its weights -> learn -> version k
               (L = 0: the push of step k happens before batch k+1 is received)

so with L = 1 batch k+1 is generated while step k trains (one-step-off-policy), and every batch is trained at most
L versions after the one that sampled it. Each response token carries that version (`rollout_versions`) and its
behaviour log-prob (`rollout_log_probs`); the trainer recomputes the proximal `old_log_probs` and corrects with the
truncated IS weight behaviour -> proximal (`algorithm.rollout_correction.rollout_is`, on by default here).

A run the trainer stops early (a signal, at a step boundary) receives the batches already on their way up to the
generator's next wait and answers it with STOP, so both processes leave together. What a checkpoint holds (the step
= the weight version, the data position of the last batch trained) is all a resume needs: batches in flight when a
run dies are generated again.
"""

from __future__ import annotations

import sys
import time

import torch

from ..parallel import shutdown
from ..parallel.groups import TRAINER, Groups, join, recv_object, send_object
from ..parallel.weight_sync import STOP, WeightSync, trainable_tensors
from .checkpoint import finish_exports
from .metrics import timer
from .preempt import Preempted, StopOnSignal, resume_message
from .rl import RLTrainer

GENERATOR = 1


def expects_weights(step: int, *, first: int, last: int, lag: int) -> bool:
    """Whether the generator, having sent batch `step`, waits for weights before generating the next one."""
    return step - lag >= first and step < last


def async_defaults(cfg, say=lambda message: None) -> None:
    """What asynchronous RL needs: the behaviour log-probs of every sampled token, and (unless bypass mode takes
    them as the old policy's) the truncated IS correction behaviour -> proximal."""
    r, rc = cfg.actor_rollout_ref.rollout, cfg.algorithm.rollout_correction
    r.calculate_log_probs = True
    if rc.rollout_is is None and not rc.bypass_mode:
        rc.rollout_is = "token"
        say("note: algorithm.rollout_correction.rollout_is=token: asynchronous RL corrects for the gap between the "
            "weights that sampled a batch and the trained ones (set bypass_mode=True to train on the behaviour "
            "log-probs instead)")


def _staleness(batch, version: int) -> dict[str, float]:
    """Mean and max over the batch's policy tokens of (the trainer's version - the version that sampled them)."""
    mask = batch["response_mask"].bool()
    if not mask.any():
        return {}
    stale = (version - batch["rollout_versions"])[mask].double()
    return {"async/staleness_mean": float(stale.mean()), "async/staleness_max": float(stale.max())}


def _bucket_bytes(cfg) -> int:
    return cfg.actor_rollout_ref.rollout.update_weights_bucket_megabytes << 20


class AsyncTrainer(RLTrainer):
    """The training process: the loop of RLTrainer.fit, with each step's batch received from the generator."""

    def __init__(self, cfg, groups: Groups):
        super().__init__(cfg, par=groups.par)
        self.groups, self.lag = groups, int(cfg.async_training.staleness_threshold)
        self.sync = WeightSync(trainable_tensors(self.parts.actor.model), src=TRAINER, bucket_bytes=_bucket_bytes(cfg))
        self.first = 1  # the first step of this run (after a resume: the checkpoint's + 1)

    def _maybe_resume(self) -> None:
        """Resume as usual, then tell the generator where to start and give it the weights of this version."""
        super()._maybe_resume()
        self.first = self.global_step + 1
        send_object({"first": self.first, "last": self.parts.total_steps, "data_cursor": self.data_cursor},
                    GENERATOR, self.groups.objects)
        self.sync.push(self.global_step)

    def _expects(self, step: int) -> bool:
        return expects_weights(step, first=self.first, last=self.parts.total_steps, lag=self.lag)

    def _training_batch(self, timing: dict):
        step, version = self.global_step, self.global_step - 1  # the weights this step starts from
        metrics = {}
        if self.lag == 0 and self._expects(step - 1):
            with timer(timing, "weight_sync"):
                self.sync.push(version)
        batch, gen_metrics, info = self._receive(timing)
        self.data_cursor = info["data_cursor"]
        if self.lag >= 1 and self._expects(step):
            with timer(timing, "weight_sync"):
                self.sync.push(version)
        if "weight_sync" in timing:
            metrics["async/weight_sync_s_per_gb"] = self.sync.seconds / max(self.sync.bytes, 1) * 2**30
            metrics["async/weight_sync_mb"] = self.sync.bytes / 2**20
        tokens = int(batch["response_mask"].sum())
        metrics |= {"async/weight_version": version, "async/rollout_version": info["version"],
                    "async/gen_idle_share": info["wait_s"] / max(info["wait_s"] + info["gen_s"], 1e-9),
                    "perf/gen_tokens_per_s": tokens / max(info["gen_s"], 1e-9)}
        return batch, gen_metrics | metrics | _staleness(batch, version)

    def _receive(self, timing: dict):
        with timer(timing, "wait_gen"):
            return recv_object(GENERATOR, self.groups.objects)

    def train_step(self) -> dict[str, float]:
        metrics = super().train_step()
        metrics["async/train_idle_share"] = metrics.get("timing_s/wait_gen", 0.0) / max(metrics["timing_s/step"],
                                                                                          1e-9)
        return metrics

    def release(self) -> None:
        """After the loop: a run stopped short of its last step takes the batches already on their way, up to the
        generator's next wait for weights, and answers that wait with STOP."""
        last = self.parts.total_steps
        step = self.global_step
        if step >= last:
            return
        if self.lag == 0:
            if self._expects(step):
                self.sync.push(STOP)
            return
        while step < last:
            step += 1
            recv_object(GENERATOR, self.groups.objects)
            if self._expects(step):
                self.sync.push(STOP)
                return


class Generator:
    """The generating process: draws the prompts, generates and scores each step's batch with its latest weights
    (RLTrainer's own generation and DAPO filtering) and sends it to the trainer. It keeps running through a signal:
    the trainer decides when the run stops and tells it."""

    def __init__(self, cfg, groups: Groups):
        self.rl = RLTrainer(cfg, par=groups.par)
        self.groups, self.lag = groups, int(cfg.async_training.staleness_threshold)
        self.sync = WeightSync(trainable_tensors(self.rl.parts.actor.model), src=TRAINER,
                               bucket_bytes=_bucket_bytes(cfg))

    def run(self) -> None:
        rl, parts = self.rl, self.rl.parts
        with StopOnSignal():
            parts.rule_reward.start()
            try:
                self._loop(rl)
            except Exception as error:  # decided here alone: the command's handlers let rank 0 speak for all
                print(f"error in the generating process (rank {self.groups.rank}): {type(error).__name__}: {error}",
                      file=sys.stderr, flush=True)
                raise
            finally:
                parts.reward.close()

    def _loop(self, rl: RLTrainer) -> None:
        start = recv_object(TRAINER, self.groups.objects)
        version = self.sync.receive()
        first, last = start["first"], start["last"]
        rl.data_cursor, wait_s = start["data_cursor"], 0.0
        for step in range(first, last + 1):
            rl.global_step = step
            timing: dict = {}
            t0 = time.perf_counter()
            batch, metrics = rl._training_batch(timing)
            metrics |= rl._program_counts()
            batch["rollout_versions"] = batch["response_mask"].long() * version
            gen_s = time.perf_counter() - t0
            send_object((batch, metrics | {f"timing_s/{k}": v for k, v in timing.items()},
                         {"version": version, "data_cursor": rl.data_cursor, "gen_s": gen_s, "wait_s": wait_s}),
                        TRAINER, self.groups.objects)
            wait_s = 0.0
            if expects_weights(step, first=first, last=last, lag=self.lag):
                t0 = time.perf_counter()
                received = self.sync.receive()
                wait_s = time.perf_counter() - t0
                if received == STOP:
                    return
                version = received


def run_async(cfg) -> dict[str, float]:
    """Train with two groups of processes (this process is one of them); raises Preempted like run_rl."""
    groups = join(device_name=cfg.trainer.device, timeout_s=cfg.async_training.wait_timeout_s)
    async_defaults(cfg, say=(lambda m: print(m, file=sys.stderr)) if groups.trains else (lambda m: None))
    torch.manual_seed(cfg.trainer.seed)
    if not groups.trains:
        Generator(cfg, groups).run()
        shutdown()
        return {}
    trainer = AsyncTrainer(cfg, groups)
    result = trainer.fit()
    trainer.release()
    shutdown()
    finish_exports()
    if trainer.preempted:
        signum, path = trainer.preempted
        raise Preempted(resume_message(signum, trainer.global_step, path), signum)
    return result
