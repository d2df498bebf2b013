"""Asynchronous RL with two groups of processes (`rollout.n_gpus_per_node` > 0): ranks 0..N-1 train
(`trainer.n_gpus_per_node` = N, FSDP2 over their own group when N > 1), the last rank generates and scores, and
generation may run ahead of training by A = floor((1 + staleness_threshold) x T) batches per weight
push, T = `async_training.trigger_parameter_sync_step` (verl's bound, counted in whole batches).

    trainer:   receive batch k -> learn -> every T steps push weights version k (to the generator's receiving thread)
    generator: wait until it holds weights of version >= k - A, take the newest -> generate batch k -> send it

The generator receives weights in a thread of its own, always ready, so a push never waits for a generation; the
weights it receives are staged and taken between batches (with `async_training.partial_rollout` also between two
decoding steps of a batch: each token is then labelled with the oldest version among the keys and values it attended
to, its prompt's, not the newer one that sampled it; docs/algorithms.md). It sends batches from another thread, so
generating the next batch never waits for the trainer to take the last one: the staleness bound alone holds
generation back. So with T = 1 and threshold 1 batch k+1 is generated while step k trains (one-step-off-policy),
threshold 0 (or 0.1) makes the groups take turns, and every batch starts at most A - 1 versions before the one it
trains at. Each response token carries that version (`rollout_versions`) and its behaviour log-prob
(`rollout_log_probs`); the trainer recomputes the proximal `old_log_probs` and corrects with the truncated IS weight
behaviour -> proximal (`algorithm.rollout_correction.rollout_is`, on by default here).

At the end, or when a signal stops the trainer after a step, the trainer pushes STOP and takes whatever batches are
still on their way until the generator says it is done, so both processes leave together. What a checkpoint holds
(the step = the weight version, the data position of the last batch trained) is all a resume needs: batches in
flight when a run dies are generated again.
"""

from __future__ import annotations

import math
import queue
import sys
import threading
import time

import torch

from ..parallel import shutdown
from ..parallel.groups import TRAINER, Groups, join, recv_object, send_object
from ..parallel.weight_sync import STOP, WeightSync, WholeTrainable, trainable_tensors
from ..rollout.weights import refresh_copy
from .checkpoint import finish_exports
from .metrics import timer
from .preempt import Preempted, StopOnSignal, resume_message
from .rl import RLTrainer

DONE = "done"  # the generator's last message: no batch follows


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


def _bucket_bytes(cfg) -> int:
    return cfg.actor_rollout_ref.rollout.update_weights_bucket_megabytes << 20


class AsyncTrainer(RLTrainer):
    """A training process: the loop of RLTrainer.fit, with each step's whole batch received from the generator
    (every training rank receives it, and its model passes compute on its share, as in synchronous RL). Training
    rank 0 pushes the weights, gathered whole from the shards when there are several training ranks."""

    def __init__(self, cfg, groups: Groups):
        super().__init__(cfg, par=groups.par)
        self.groups = groups
        pushes = groups.rank == TRAINER
        self.whole = WholeTrainable(self.parts.actor.model, keep=pushes, device=groups.par.device)
        self.sync = (WeightSync(self.whole.tensors, src=TRAINER, group=groups.push, bucket_bytes=_bucket_bytes(cfg))
                     if pushes else None)

    def _push(self, version: int) -> None:
        """Every training rank calls this (the gathering of the shards is theirs); rank 0 sends."""
        if version >= 0:
            self.whole.gather()
        if self.sync is not None:
            self.sync.push(version)

    def _maybe_resume(self) -> None:
        """Resume as usual, then tell the generator where to start and give it the weights of this version."""
        super()._maybe_resume()
        if self.sync is not None:
            send_object({"first": self.global_step + 1, "last": self.parts.total_steps,
                         "data_cursor": self.data_cursor}, self.groups.generator, self.groups.objects)
        self._push(self.global_step)

    def _training_batch(self, timing: dict):
        version = self.global_step - 1  # the weights this step starts from
        with timer(timing, "wait_gen"):
            batch, gen_metrics, info = recv_object(self.groups.generator, self.groups.objects)
        self.data_cursor = info["data_cursor"]
        tokens = int(batch["response_mask"].sum())
        metrics = {"async/weight_version": version, "async/rollout_version": info["version"],
                   "async/gen_idle_share": info["wait_s"] / max(info["wait_s"] + info["gen_s"], 1e-9),
                   "perf/gen_tokens_per_s": tokens / max(info["gen_s"], 1e-9)}
        return batch, gen_metrics | metrics  # learn() adds the staleness (algo/staleness.py)

    def train_step(self) -> dict[str, float]:
        metrics = super().train_step()
        metrics["async/train_idle_share"] = metrics.get("timing_s/wait_gen", 0.0) / max(metrics["timing_s/step"],
                                                                                          1e-9)
        every = self.cfg.async_training.trigger_parameter_sync_step
        if self.global_step < self.parts.total_steps and self.global_step % every == 0:  # the next batches want them
            self._push(self.global_step)
            if self.sync is not None:  # rank 0 pushed (and logs)
                metrics |= {"timing_s/weight_sync": self.sync.seconds,
                            "async/weight_sync_mb": self.sync.bytes / 2**20,
                            "async/weight_sync_s_per_gb": self.sync.seconds / max(self.sync.bytes, 1) * 2**30}
        return metrics

    def release(self) -> None:
        """After the loop (the last step, or a stop): STOP to the generator, then take the batches still on their
        way until it says it is done."""
        self._push(STOP)
        while not isinstance(item := recv_object(self.groups.generator, self.groups.objects), str) or item != DONE:
            pass


class WeightInbox:
    """The generator's receiving side: a thread that waits for each push and stages it; `take_newest` copies the
    newest staged weights into the model between batches, and with partial rollouts `between_steps` does so between
    two decoding steps. Costs two copies of the trainable tensors (under LoRA the adapters alone): the one a push is
    received into, and the staged one. `current` is the version the model holds."""

    def __init__(self, model: torch.nn.Module, bucket_bytes: int, timeout_s: float, current: int = 0, group=None):
        self.owner, self.model = model, trainable_tensors(model)
        self.incoming = {n: t.detach().clone() for n, t in self.model.items()}
        self.staged = {n: t.detach().clone() for n, t in self.model.items()}
        self.sync = WeightSync(self.incoming, src=TRAINER, group=group, bucket_bytes=bucket_bytes)
        self.timeout_s, self.current = timeout_s, current
        self.cond = threading.Condition()
        self.staged_version, self.stopped, self.error = -1, False, None
        self.thread = threading.Thread(target=self._receive_all, name="weight-inbox", daemon=True)
        self.thread.start()

    def _receive_all(self) -> None:
        try:
            device = next(iter(self.incoming.values())).device if self.incoming else torch.device("cpu")
            if device.type == "cuda":  # a thread starts on GPU 0: receive on this process's GPU
                torch.cuda.set_device(device)
            while True:
                version = self.sync.receive()
                with self.cond:
                    if version == STOP:
                        self.stopped = True
                    else:
                        for name, t in self.incoming.items():
                            self.staged[name].copy_(t)
                        self.staged_version = version
                    self.cond.notify_all()
                if version == STOP:
                    return
        except BaseException as error:  # noqa: BLE001 - the main thread raises it
            with self.cond:
                self.error = error
                self.cond.notify_all()

    def _raise_error(self) -> None:
        if self.error is not None:
            raise RuntimeError(f"receiving weights failed: {self.error}") from self.error

    @torch.no_grad()
    def take_newest(self, need: int) -> int | None:
        """Wait until weights of version >= `need` are staged (or held already), copy the newest into the model,
        and return its version; None once the trainer said STOP."""
        deadline = time.monotonic() + self.timeout_s
        with self.cond:
            while max(self.staged_version, self.current) < need and not self.stopped and self.error is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"no weights of version {need} from the trainer within "
                                       f"async_training.wait_timeout_s={self.timeout_s:g} s")
                self.cond.wait(left)
            self._raise_error()
            if self.stopped:
                return None
            if self.staged_version > self.current:
                for name, t in self.staged.items():
                    self.model[name].copy_(t)
                self.current = self.staged_version
            return self.current

    @torch.no_grad()
    def between_steps(self, decoding) -> int:
        """Partial rollouts: newer staged weights, if any, into the model and into `decoding` (the engine's
        decoding weights: the model itself, or its copy in the compute dtype with LoRA adapters merged); never
        waits. Keys and values already computed stay as older weights made them. Returns the version the next
        token is sampled with."""
        with self.cond:
            self._raise_error()
            if self.staged_version > self.current and not self.stopped:
                for name, t in self.staged.items():
                    self.model[name].copy_(t)
                held = {id(t) for t in self.model.values()}
                if not any(id(p) in held for p in decoding.parameters()):  # a copy: by name, adapters merged
                    refresh_copy(decoding, self.owner, list(self.model))
                self.current = self.staged_version
            return self.current


class Outbox:
    """The generator's sending side: a thread that sends the queued batches to the training ranks in order, so
    generating the next batch never waits for the trainers to take the last one (the staleness bound is what holds
    generation back). Ends after sending DONE."""

    def __init__(self, group, trainers: list[int]):
        self.group, self.trainers, self.queue, self.error = group, trainers, queue.Queue(), None
        self.thread = threading.Thread(target=self._send_all, name="batch-outbox", daemon=True)
        self.thread.start()

    def put(self, item) -> None:
        self.queue.put(item)

    def _send_all(self) -> None:
        try:
            while True:
                item = self.queue.get()
                send_object(item, self.trainers, self.group)
                if isinstance(item, str) and item == DONE:
                    return
        except BaseException as error:  # noqa: BLE001 - the main thread raises it
            self.error = error


class Generator:
    """The generating process: draws the prompts, generates and scores each step's batch with its newest weights
    (RLTrainer's own generation and DAPO filtering) and sends it to the trainer. It keeps running through a signal:
    the trainer decides when the run stops and tells it."""

    def __init__(self, cfg, groups: Groups):
        self.rl = RLTrainer(cfg, par=groups.par)
        self.cfg, self.groups = cfg, groups
        at = cfg.async_training
        # batch k may be sampled by weights of version >= k - ahead (verl's (1 + threshold) x T, whole batches)
        self.ahead = math.floor((1 + at.staleness_threshold) * at.trigger_parameter_sync_step + 1e-9)
        self.tensors = trainable_tensors(self.rl.parts.actor.model)

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
        bucket, timeout = _bucket_bytes(self.cfg), self.cfg.async_training.wait_timeout_s
        push = self.groups.push
        version = WeightSync(self.tensors, src=TRAINER, group=push, bucket_bytes=bucket).receive()  # at the start
        inbox = WeightInbox(self.rl.parts.actor.model, bucket, timeout, current=version, group=push)
        if self.cfg.async_training.partial_rollout:
            rl.parts.engine.between_steps = inbox.between_steps
        outbox = Outbox(self.groups.objects, list(range(self.groups.trainers)))
        rl.data_cursor = start["data_cursor"]
        for step in range(start["first"], start["last"] + 1):
            t0 = time.perf_counter()
            if outbox.error is not None:
                raise RuntimeError(f"sending batches failed: {outbox.error}") from outbox.error
            newest = inbox.take_newest(need=step - self.ahead)
            if newest is None:  # the trainer stopped early
                break
            version, wait_s = newest, time.perf_counter() - t0
            rl.global_step = step
            timing: dict = {}
            t0 = time.perf_counter()
            batch, metrics = rl._training_batch(timing)
            metrics |= rl._program_counts()
            if "rollout_versions" not in batch:  # partial rollouts: the engine's, per token
                batch["rollout_versions"] = batch["response_mask"].long() * version
            # partial rollouts: versions swapped in while the batch decoded (its tokens' labels are older, what
            # their keys saw, so the staleness metrics do not show these swaps)
            metrics["async/versions_taken_mid_batch"] = inbox.current - version
            gen_s = time.perf_counter() - t0
            outbox.put((batch, metrics | {f"timing_s/{k}": v for k, v in timing.items()},
                        {"version": version, "data_cursor": rl.data_cursor, "gen_s": gen_s, "wait_s": wait_s}))
        outbox.put(DONE)
        outbox.thread.join(timeout)
        inbox.thread.join(timeout)
        for error, what in ((outbox.error, "sending batches"), (inbox.error, "receiving weights")):
            if error is not None:
                raise RuntimeError(f"{what} failed: {error}") from error


def run_async(cfg) -> dict[str, float]:
    """Train with two groups of processes (this process is one of them); raises Preempted like run_rl."""
    tr = cfg.trainer
    groups = join(device_name=tr.device, timeout_s=cfg.async_training.wait_timeout_s,
                  trainers=tr.nnodes * tr.n_gpus_per_node,
                  fsdp_size=cfg.actor_rollout_ref.actor.fsdp_config.fsdp_size)
    async_defaults(cfg, say=(lambda m: print(m, file=sys.stderr)) if groups.rank == TRAINER else (lambda m: None))
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
