"""Predicted speedup of asynchronous over synchronous RL at 8, 64 and 256 GPUs: a discrete-event simulation fed
with per-phase costs measured on real posttrain steps.

    python benchmarks/async_sim.py [--workdir DIR] [--save-costs FILE | --costs FILE | --costs h20-7b]
                                   [--gpus 8,64,256] [--splits 0.25,...] [--median 3000 --sigma 0.9 --max-len 28672]
                                   [--train-scaling 1] [--bypass] [--staleness 0.5] [--no-partial] [--steps 8]
                                   [--seed 0]

1. Costs. Unless `--costs` is given, the script first runs GRPO steps of the random S model of
   benchmarks/grpo_step.py on this machine (GSM8K prompts, fp32, every response exactly L tokens, rollout
   log-probs on so that the old log-probs are recomputed as an asynchronous trainer must) at 4 shapes: 2 or 16
   prompts x 8 samples, 16 or 64 new tokens. It fits `timing_s/gen` = L x (step + seq x B) + prefill x (prompt
   tokens of the B sequences): a decoding step's fixed cost, what each live sequence adds to a step, and prefill per
   prompt token; it takes the update and old log-prob costs per token (prompt + response) from
   `timing_s/update_actor` and `timing_s/old_log_prob`; and it times a bucketed copy of the weights (the memory
   traffic of a weight sync at one end) as the sync cost. `--save-costs` writes them as JSON for `--costs`. (A
   run's metrics.jsonl holds one batch shape, which cannot separate the per-step from the per-sequence cost.)
   `--costs h20-7b`: data-sheet costs of Qwen2.5-7B on H20 GPUs instead (see `h20_7b`), not measured.
2. Workload, as verl's fully-async 7B example (docs/advance/fully_async.md): 512 prompts x 16 responses per step,
   ppo_mini_batch_size 32 prompts, require_batches 4, trigger_parameter_sync_step 4 (one weight sync per 512
   prompts, as the synchronous step), prompts of 256 tokens, response lengths lognormal (median `--median`,
   log-sd `--sigma`) cut at `--max-len` (verl's run: max_response_length 28K), at most 256 live sequences per
   generating GPU (verl's `rollout.max_num_seqs` default).
3. Scaling assumptions. One GPU = one measured worker. A generating GPU decodes with the measured costs (continuous
   batching; each new sequence goes to the GPU with the fewest unfinished ones; a prefill stalls its GPU's
   decoding); training on all G GPUs costs the per-token costs / G, on a share f of them f ** -`--train-scaling`
   times as long (1: perfect data parallelism); a weight sync costs the measured copy whatever the GPU count.
   Per-token costs do not grow with the context.
4. Modes, on G GPUs in all: `sync` (all G generate, the step waits for its longest response, then all G compute
   old log-probs and update); `one-step-off` (G_gen GPUs generate batch i+1 while the other G_train train on batch
   i; one weight sync per step); `fully-async` (`--staleness` 0.5, partial rollouts unless `--no-partial`: the
   generators stream prompts, admitting at most (version + 1.5) x 512 prompts in all; the trainer takes the first
   128 finished prompts per update and after 4 updates pushes its weights, pausing generation for the sync without
   waiting for the responses in flight; without partial rollouts admission stops and the sync waits for them).
   The split G_gen : G_train is the best of `--splits` (shares of G, default 1/4, 3/8, 1/2, 5/8, 3/4) for each
   async mode; verl's runs used 1/2. `--bypass`: the async modes skip the old log-prob pass (verl's fully-async
   default, rollout log-probs as the old policy's).

Output: per GPU count and mode, the step time (seconds of the measured worker), the speedup over `sync`, the
split, the idle shares (generating GPUs with no live sequence; training GPUs not training: waiting for data or a
sync) and the mean staleness of the trained responses (weight versions between admission and training).
docs/scaling.md, section 8, compares it with verl's published numbers.
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import random
import statistics
import sys
import tempfile
import time
from collections import deque
from dataclasses import asdict, dataclass
from pathlib import Path

INF = float("inf")


@dataclass(frozen=True)
class Costs:
    """Seconds on one worker (one GPU in the prediction)."""

    step: float  # a decoding step's fixed cost (reading the weights, launching kernels)
    seq: float  # what each live sequence adds to a decoding step
    prefill: float  # prefill per prompt token of a sequence (its prompt's pass), stalling its GPU's decoding
    train_token: float  # the update (forward + backward + optimizer) per token (prompt + response)
    sync: float  # one weight sync (trainer -> generators); generation and training both wait for it
    logprob_token: float = 0.0  # the old log-prob pass per token


@dataclass(frozen=True)
class Workload:
    """One step's work and the settings of the modes, as in verl's fully-async 7B runs."""

    prompts: int = 512  # per step (verl's train_batch_size)
    n: int = 16  # responses per prompt
    mini_prompts: int = 32  # ppo_mini_batch_size
    require_batches: int = 4  # mini-batches per local update (fully async)
    trigger: int = 4  # local updates per weight sync (fully async): 4 x 4 x 32 = 512 prompts
    prompt_len: int = 256
    median: float = 3000.0  # response length: lognormal median (tokens) ...
    sigma: float = 0.9  # ... and log-standard deviation ...
    max_len: int = 28672  # ... cut at max_response_length
    max_seqs: int = 256  # live sequences per generating GPU
    train_scaling: float = 1.0  # training on a share f of the GPUs takes f ** -train_scaling times as long as on all
    async_old_log_prob: bool = True  # the async modes run the old log-prob pass too (verl's bypass mode: False)
    staleness: float = 0.5  # fully async: staleness_threshold
    partial: bool = True  # fully async: partial rollouts

    def lengths(self, rng: random.Random, k: int) -> list[int]:
        mu = math.log(self.median)
        return [min(self.max_len, max(1, round(rng.lognormvariate(mu, self.sigma)))) for _ in range(k)]


# ---------------------------------------------------------------- generation: continuous batching per GPU

class Gpu:
    """One generating GPU. Every live sequence advances one token per decoding step, and a step costs
    step + seq x live, so between two events a GPU's `progress` (tokens decoded by each live sequence) grows at a
    constant rate; a sequence is stored as the progress at which it finishes."""

    __slots__ = ("costs", "max_seqs", "prefill", "live", "queue", "progress", "last", "stall_end", "busy", "stamp")

    def __init__(self, costs: Costs, max_seqs: int, prompt_len: int):
        self.costs, self.max_seqs, self.prefill = costs, max_seqs, costs.prefill * prompt_len
        self.live: list[tuple[float, int]] = []  # heap of (progress at which it finishes, sequence id)
        self.queue: deque = deque()  # (sequence id, tokens left) waiting for a slot
        self.progress = self.last = self.stall_end = self.busy = 0.0
        self.stamp = 0

    def step_time(self) -> float:
        return self.costs.step + self.costs.seq * len(self.live)

    def advance(self, t: float) -> None:
        if self.live:
            start = max(self.last, self.stall_end)
            if t > start:
                self.progress += (t - start) / self.step_time()
            self.busy += t - self.last
        self.last = max(self.last, t)

    def start(self, t: float, seq: int, tokens: float) -> None:
        self.stall_end = max(self.stall_end, t) + self.prefill
        heapq.heappush(self.live, (self.progress + tokens, seq))

    def next_time(self) -> float:
        if not self.live:
            return INF
        return max(self.last, self.stall_end) + max(0.0, self.live[0][0] - self.progress) * self.step_time()

    def finish(self, t: float) -> list[int]:
        """Advance to `t` and take out the sequences done by then; queued ones take the freed slots."""
        self.advance(t)
        done = []
        while self.live and self.live[0][0] <= self.progress + 1e-9 * max(1.0, self.progress):
            done.append(heapq.heappop(self.live)[1])
        while self.queue and len(self.live) < self.max_seqs:
            self.start(t, *self.queue.popleft())
        return done


class Rollout:
    """G generating GPUs. A new sequence goes to the GPU with the fewest unfinished sequences (the first such on a
    tie, so a batch submitted at once is dealt round-robin); `next_time` / `pop` walk the completions in order."""

    def __init__(self, costs: Costs, gpus: int, max_seqs: int, prompt_len: int):
        self.gpus = [Gpu(costs, max_seqs, prompt_len) for _ in range(gpus)]
        self.events: list[tuple[float, int, int]] = []  # (time, gpu, stamp); stale stamps are skipped
        self.load = [0] * gpus  # unfinished sequences per GPU
        self.in_flight = 0

    def _schedule(self, i: int) -> None:
        g = self.gpus[i]
        g.stamp += 1
        when = g.next_time()
        if when < INF:
            heapq.heappush(self.events, (when, i, g.stamp))

    def submit(self, t: float, seq: int, tokens: float) -> None:
        i = self.load.index(min(self.load))
        self.load[i] += 1
        g = self.gpus[i]
        g.advance(t)
        if len(g.live) < g.max_seqs:
            g.start(t, seq, tokens)
        else:
            g.queue.append((seq, tokens))
        self.in_flight += 1
        self._schedule(i)

    def next_time(self) -> float:
        while self.events and self.events[0][2] != self.gpus[self.events[0][1]].stamp:
            heapq.heappop(self.events)
        return self.events[0][0] if self.events else INF

    def pop(self) -> tuple[float, list[int]]:
        t = self.next_time()
        i = self.events[0][1]
        done = self.gpus[i].finish(t)
        self.in_flight -= len(done)
        self.load[i] -= len(done)
        self._schedule(i)
        return t, done

    def pause(self, t: float, seconds: float) -> None:
        """A weight sync: every GPU stops decoding for `seconds`; live sequences resume afterwards (partial
        rollout: nothing is thrown away)."""
        for i, g in enumerate(self.gpus):
            g.advance(t)
            g.stall_end = max(g.stall_end, t) + seconds
            self._schedule(i)

    def idle(self, until: float) -> float:
        """GPU-seconds with no live sequence, from 0 to `until`."""
        return sum(until - g.busy - (until - g.last if g.live else 0.0) for g in self.gpus)


def generate_batch(costs: Costs, gpus: int, lengths: list[int], max_seqs: int, prompt_len: int) -> tuple[float, float]:
    """(time until the last of `lengths` is done, idle GPU-seconds) for one batch started at once."""
    r = Rollout(costs, gpus, max_seqs, prompt_len)
    for seq, tokens in enumerate(lengths):
        r.submit(0.0, seq, tokens)
    t = 0.0
    while r.in_flight:
        t, _ = r.pop()
    return t, r.idle(t)


# ---------------------------------------------------------------- the three modes

@dataclass
class Result:
    step: float  # mean seconds per 512-prompt step (steady state)
    gen_idle: float  # share of the generating GPUs' time with no live sequence
    train_idle: float  # share of the training GPUs' time not training (waiting for data or for a sync)
    staleness: float  # mean weight versions between a response's admission and its training
    gen_gpus: int = 0


def train_time(costs: Costs, w: Workload, tokens: int, gpus: int, total: int, asynchronous: bool) -> float:
    """Seconds to train on `tokens` with `gpus` of the job's `total` GPUs: per-token costs / total, times
    (total / gpus) ** train_scaling (1: perfect data parallelism)."""
    per_token = costs.train_token + (costs.logprob_token if w.async_old_log_prob or not asynchronous else 0.0)
    return per_token * tokens / total * (total / gpus) ** w.train_scaling


def sync_mode(costs: Costs, w: Workload, gpus: int, steps: int, rng: random.Random) -> Result:
    """Colocated: all GPUs generate the step's batch, wait for its longest response, then all train on it."""
    total = idle = 0.0
    for _ in range(steps):
        lengths = w.lengths(rng, w.prompts * w.n)
        gen, gen_idle = generate_batch(costs, gpus, lengths, w.max_seqs, w.prompt_len)
        train = train_time(costs, w, sum(lengths) + w.prompt_len * len(lengths), gpus, gpus, False)
        total += gen + train
        idle += gen_idle
    return Result(total / steps, idle / (gpus * total), 0.0, 0.0, gpus)


def pipeline_mode(costs: Costs, w: Workload, gen_gpus: int, train_gpus: int, steps: int, rng: random.Random,
                  off: int = 1) -> Result:
    """Generation on `gen_gpus`, training on `train_gpus`. Batch i is sampled with the weights of update i-1-off
    (`off`=1: one-step-off-policy; 0: the two groups take turns). A batch's generation starts when the previous
    batch is generated and those weights have arrived; its training when it is generated and the previous update
    and its weight push are done."""
    gen_end, push_end, trained, idle_gen = [], [], 0.0, 0.0
    for i in range(steps):
        lengths = w.lengths(rng, w.prompts * w.n)
        gen, gen_idle = generate_batch(costs, gen_gpus, lengths, w.max_seqs, w.prompt_len)
        start = max(gen_end[-1] if gen_end else 0.0, push_end[i - 1 - off] if i - 1 - off >= 0 else 0.0)
        gen_end.append(start + gen)
        idle_gen += gen_idle + gen_gpus * (start - (gen_end[-2] if i else 0.0))
        train = train_time(costs, w, sum(lengths) + w.prompt_len * len(lengths), train_gpus,
                           gen_gpus + train_gpus, True)
        begin = max(gen_end[-1], push_end[-1] if push_end else 0.0)
        push_end.append(begin + train + costs.sync)
        trained += train
    skip = min(2, steps - 1)
    step = (push_end[-1] - push_end[skip - 1]) / (steps - skip) if skip else push_end[-1] / steps
    wall = push_end[-1]
    return Result(step, idle_gen / (gen_gpus * wall), 1 - trained / wall, float(off), gen_gpus)


def fully_async_mode(costs: Costs, w: Workload, gen_gpus: int, train_gpus: int, steps: int, rng: random.Random,
                     staleness: float | None = None, partial: bool | None = None) -> Result:
    """verl's fully async policy. The generators admit prompts while the admitted total stays within
    (version + 1 + staleness) x U, U the prompts per weight version; each admitted prompt's n responses are dealt
    to the GPUs. The trainer takes the R = require_batches x ppo_mini_batch_size prompts finished first, trains on
    them, and after `trigger` such updates pushes its weights (version + 1). With `partial`, the push pauses
    generation for the sync and the responses in flight continue afterwards with the new weights; without it,
    admission stops and the push waits until every admitted response is done."""
    staleness = w.staleness if staleness is None else staleness
    partial = w.partial if partial is None else partial
    R = w.require_batches * w.mini_prompts
    U = w.trigger * R
    r = Rollout(costs, gen_gpus, w.max_seqs, w.prompt_len)
    version = admitted = updates = 0
    left: dict[int, int] = {}  # prompt -> responses not yet done
    tokens: dict[int, int] = {}  # prompt -> prompt + response tokens
    born: dict[int, int] = {}  # prompt -> version it was admitted under
    done: deque = deque()  # finished prompts, in finishing order
    draining = False
    trainer_start, trainer_end, trainer_job, trained = 0.0, INF, None, 0.0
    sync_ends: list[float] = []
    stale: list[int] = []
    t = 0.0

    def admit(now: float) -> None:
        nonlocal admitted
        while not draining and admitted < (version + 1 + staleness) * U:
            p = admitted
            admitted += 1
            lengths = w.lengths(rng, w.n)
            left[p], tokens[p], born[p] = w.n, sum(lengths) + w.prompt_len * w.n, version
            for k, n_tok in enumerate(lengths):
                r.submit(now, p * w.n + k, n_tok)

    def start_sync(now: float) -> None:
        nonlocal trainer_end, trainer_job, version
        r.pause(now, costs.sync)
        trainer_end, trainer_job = now + costs.sync, "sync"
        version += 1

    def try_train(now: float) -> None:
        nonlocal trainer_end, trainer_job, trainer_start
        if trainer_job is None and not draining and len(done) >= R:
            batch = [done.popleft() for _ in range(R)]
            stale.extend(version - born[p] for p in batch)
            secs = train_time(costs, w, sum(tokens[p] for p in batch), train_gpus, gen_gpus + train_gpus, True)
            trainer_start, trainer_end, trainer_job = now, now + secs, "train"

    admit(0.0)
    while len(sync_ends) < steps:
        t_gen = r.next_time()
        if trainer_end <= t_gen:
            t, job = trainer_end, trainer_job
            trainer_end, trainer_job = INF, None
            if job == "sync":
                sync_ends.append(t)
            else:
                trained += t - trainer_start
                updates += 1
                if updates % w.trigger == 0:
                    if partial or r.in_flight == 0:
                        start_sync(t)
                    else:
                        draining = True
        else:
            if t_gen == INF:
                raise RuntimeError("the simulation stalled: nothing in flight and the trainer has no work")
            t, seqs = r.pop()
            for s in seqs:
                p = s // w.n
                left[p] -= 1
                if left[p] == 0:
                    done.append(p)
            if draining and r.in_flight == 0:
                draining = False
                start_sync(t)
        admit(t)
        try_train(t)
    skip = min(2, steps - 1)
    step = (sync_ends[-1] - sync_ends[skip - 1]) / (steps - skip) if skip else sync_ends[-1] / steps
    wall = sync_ends[-1]
    return Result(step, r.idle(wall) / (gen_gpus * wall), 1 - trained / wall, statistics.fmean(stale), gen_gpus)


SPLITS = (1 / 4, 3 / 8, 1 / 2, 5 / 8, 3 / 4)


def best_split(run, gpus: int, splits=SPLITS) -> Result:
    """The run with the fastest step over the generating shares `splits` (whole GPUs, at least one per group)."""
    best = None
    for share in splits:
        g = min(gpus - 1, max(1, round(gpus * share)))
        res = run(g, gpus - g)
        if best is None or res.step < best.step:
            best = res
    return best


def predict(costs: Costs, w: Workload, gpus: int, steps: int, seed: int, splits=SPLITS) -> dict[str, Result]:
    """The three modes on `gpus` GPUs, each on the same seeded response lengths."""
    out = {"sync": sync_mode(costs, w, gpus, steps, random.Random(seed))}
    out["one-step-off"] = best_split(
        lambda g, t: pipeline_mode(costs, w, g, t, steps, random.Random(seed), off=1), gpus, splits)
    out["fully-async"] = best_split(
        lambda g, t: fully_async_mode(costs, w, g, t, steps, random.Random(seed)), gpus, splits)
    return out


def h20_7b(w: Workload, seed: int, gpus: int = 128, update: float = 113.81 / 177.85,
           old_log_prob: float = 53.92 / 177.85) -> Costs:
    """Not measured: Qwen2.5-7B on H20 GPUs, to see what memory-bound decoding changes. From the H20's data sheet
    (4.0 TB/s, 148 TFLOP/s bf16 dense): a decoding step reads the 15.2 GB of bf16 weights once (3.81 ms); a live
    sequence adds 2P FLOPs at half the peak (0.206 ms) and reads its keys and values (57.3 kB per token x 2,500
    tokens of mean context: 0.036 ms); prefill is 2P FLOPs per prompt token at half the peak; the sync is verl's
    measured 7B weight sync (0.12 s, fully_async.md). The training cost per token is set so that the `sync` step on
    `gpus` GPUs splits between the phases as verl's colocated 128-GPU run did (gen 177.85 s, old_log_prob 53.92 s,
    update_actor 113.81 s)."""
    p = 7.62e9
    decode = Costs(step=2 * p / 4.0e12, seq=2 * p / (0.5 * 148e12) + 57.3e3 * 2500 / 4.0e12,
                   prefill=2 * p / (0.5 * 148e12), train_token=0.0, sync=0.12)
    lengths = w.lengths(random.Random(seed), w.prompts * w.n)
    gen, _ = generate_batch(decode, gpus, lengths, w.max_seqs, w.prompt_len)
    tokens = sum(lengths) + w.prompt_len * len(lengths)
    per_gen = gen * gpus / tokens
    return Costs(**{**asdict(decode), "train_token": update * per_gen, "logprob_token": old_log_prob * per_gen})


# ---------------------------------------------------------------- measuring the costs on real posttrain steps

SHAPES = ((2, 16), (2, 64), (16, 16), (16, 64))  # (prompts, new tokens); 8 samples each


def measure(workdir: Path, model: str = "S", steps: int = 2) -> tuple[Costs, list[dict]]:
    """Fit the cost model to GRPO steps of grpo_step.py's `model` at SHAPES (one warm-up step each)."""
    import numpy as np
    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import grpo_step

    grpo_step.build(workdir, [model])
    points = []
    for prompts, new in SHAPES:
        grpo_step.PROMPTS, grpo_step.NEW_TOKENS = prompts, new
        torch.manual_seed(0)
        # rollout log-probs on: the trainer then recomputes the old log-probs, as an asynchronous trainer must
        trainer = grpo_step.posttrain_trainer(workdir, model, "fp32", steps + 1, "cpu",
                                              "actor_rollout_ref.rollout.calculate_log_probs=True")
        rows = []
        for _ in range(steps + 1):
            trainer.global_step += 1
            m = trainer.train_step()
            rows.append(m)
        rows = rows[1:]
        b = prompts * grpo_step.N
        points.append(dict(
            prompts=prompts, rows=b, new=new, prompt_len=statistics.median(m["prompt_length/mean"] for m in rows),
            gen=statistics.median(m["timing_s/gen"] for m in rows),
            train=statistics.median(m["timing_s/update_actor"] for m in rows),
            logprob=statistics.median(m.get("timing_s/old_log_prob", 0.0) for m in rows),
            tokens=statistics.median((m["prompt_length/mean"] + m["response_length/mean"]) * b for m in rows)))
    design = np.array([[p["new"], p["new"] * p["rows"], p["rows"] * p["prompt_len"]] for p in points], dtype=float)
    fit, *_ = np.linalg.lstsq(design, np.array([p["gen"] for p in points]), rcond=None)
    step, seq, prefill = (max(float(x), 0.0) for x in fit)
    tokens = sum(p["tokens"] for p in points)
    return Costs(step, seq, prefill, sum(p["train"] for p in points) / tokens,
                 sync_copy_seconds(trainer.parts.actor.model), sum(p["logprob"] for p in points) / tokens), points


def sync_copy_seconds(model, bucket_bytes: int = 25 * 2**20, repeats: int = 5) -> float:
    """A bucketed weight push, minus the wire: pack the parameters into flat buckets and unpack them into a second
    copy of the weights (best of `repeats`)."""
    import torch

    params = [p.detach() for p in model.parameters()]
    targets = [torch.empty_like(p) for p in params]
    best = INF
    for _ in range(repeats):
        start = time.perf_counter()
        i = 0
        while i < len(params):
            j, size = i, 0
            while j < len(params) and (j == i or size + params[j].numel() * params[j].element_size() <= bucket_bytes):
                size += params[j].numel() * params[j].element_size()
                j += 1
            flat = torch.cat([p.reshape(-1) for p in params[i:j]])
            offset = 0
            for p, q in zip(params[i:j], targets[i:j]):
                q.copy_(flat[offset:offset + p.numel()].view_as(q))
                offset += p.numel()
            i = j
        best = min(best, time.perf_counter() - start)
    return best


# ---------------------------------------------------------------- report

def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workdir", help="where the model and data for the measurement are built (default: a temp dir)")
    p.add_argument("--costs", help="JSON of the costs (as --save-costs writes them), or `h20-7b` (h20_7b's "
                   "data-sheet costs, not measured): skip the measurement")
    p.add_argument("--splits", default=",".join(f"{x:g}" for x in SPLITS),
                   help="generating shares of the GPUs tried for the async modes (the best is kept)")
    p.add_argument("--save-costs", help="write the measured costs to this JSON file")
    p.add_argument("--gpus", default="8,64,256")
    p.add_argument("--steps", type=int, default=8, help="steps simulated per mode (the first 2 are left out)")
    p.add_argument("--median", type=float, default=Workload.median)
    p.add_argument("--sigma", type=float, default=Workload.sigma)
    p.add_argument("--max-len", type=int, default=Workload.max_len)
    p.add_argument("--train-scaling", type=float, default=1.0,
                   help="training time ~ tokens / GPUs ** this (1: perfect data parallelism)")
    p.add_argument("--bypass", action="store_true",
                   help="the async modes skip the old log-prob pass (verl's fully async default)")
    p.add_argument("--staleness", type=float, default=Workload.staleness, help="fully async: staleness_threshold")
    p.add_argument("--no-partial", action="store_true", help="fully async without partial rollouts")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    w = Workload(median=args.median, sigma=args.sigma, max_len=args.max_len, train_scaling=args.train_scaling,
                 async_old_log_prob=not args.bypass, staleness=args.staleness, partial=not args.no_partial)
    if args.costs == "h20-7b":
        costs = h20_7b(w, args.seed)
        print("# costs: Qwen2.5-7B on H20 from the data sheet, training calibrated to verl's colocated 128-GPU run")
    elif args.costs:
        costs = Costs(**json.loads(Path(args.costs).read_text()))
        print(f"# costs from {args.costs}")
    else:
        workdir = Path(args.workdir or tempfile.mkdtemp(prefix="async_sim_"))
        workdir.mkdir(parents=True, exist_ok=True)
        start = time.perf_counter()
        costs, points = measure(workdir)
        print(f"# measured in {time.perf_counter() - start:.0f} s on GRPO steps of grpo_step.py's S model (fp32):")
        for pt in points:
            fit = pt["new"] * (costs.step + costs.seq * pt["rows"]) + costs.prefill * pt["rows"] * pt["prompt_len"]
            print(f"#   {pt['rows']:4d} sequences x {pt['new']:3d} tokens (prompts {pt['prompt_len']:.0f}): "
                  f"gen {pt['gen']:.3f} s (fit {fit:.3f}), update {pt['train']:.3f} s + old log-probs "
                  f"{pt['logprob']:.3f} s for {pt['tokens']:.0f} tokens")
        if args.save_costs:
            Path(args.save_costs).write_text(json.dumps(asdict(costs), indent=1) + "\n")
    print(f"# costs: decoding step {costs.step * 1e3:.3f} ms + {costs.seq * 1e6:.2f} us per live sequence, "
          f"prefill {costs.prefill * 1e6:.2f} us per prompt token, update {costs.train_token * 1e6:.2f} + old "
          f"log-probs {costs.logprob_token * 1e6:.2f} us per token, weight sync {costs.sync * 1e3:.3f} ms; training "
          f"on a share f of the GPUs x f^-{w.train_scaling:g}, async modes " + ("skip" if args.bypass else "run")
          + " the old log-prob pass")
    sample = sorted(w.lengths(random.Random(args.seed), w.prompts * w.n))
    print(f"# responses: lognormal median {w.median:.0f}, sigma {w.sigma}, cut at {w.max_len}: one step's mean "
          f"{statistics.fmean(sample):.0f}, p99 {sample[int(0.99 * len(sample))]}, max {sample[-1]}, "
          f"{sum(x == w.max_len for x in sample)} of {len(sample)} cut")
    start = time.perf_counter()
    print("\n| GPUs | mode | gen : train GPUs | s / step | speedup | gen GPUs idle | train GPUs idle | staleness |")
    print("|---|---|---|---|---|---|---|---|")
    for gpus in (int(x) for x in args.gpus.split(",")):
        res = predict(costs, w, gpus, args.steps, args.seed, [float(x) for x in args.splits.split(",")])
        base = res["sync"].step
        for mode, r in res.items():
            split = f"{gpus} (shared)" if mode == "sync" else f"{r.gen_gpus} : {gpus - r.gen_gpus}"
            train_idle = "-" if mode == "sync" else f"{100 * r.train_idle:.0f}%"
            print(f"| {gpus} | {mode} | {split} | {r.step:.1f} | {base / r.step:.2f}x | {100 * r.gen_idle:.0f}% | "
                  f"{train_idle} | {r.staleness:.2f} |", flush=True)
    print(f"\n# simulated in {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
