"""The training side of one GRPO step with and without computing each prompt once, side by side.

    python benchmarks/shared_prompt.py [--models S,M] [--dtypes bf16] [--repeats 3] [--device cpu|cuda]
                                       [--workdir DIR]

The workload of benchmarks/grpo_step.py (16 GSM8K prompts x 8 responses of 64 tokens, Dr. GRPO, one optimizer step):
one batch is generated, then `RLTrainer.learn` runs on it alternately with plain `prompt || response` rows and with
shared prompts (models/shared_prompt.py), `--repeats` times each, in one process. Prints the median seconds and the
ratio, the largest log-prob difference between the two paths on that batch, and on `--device cuda` the peak GPU
memory of each path's `learn`.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from grpo_step import build, posttrain_trainer
from posttrain.models.shared_prompt import ATTENTION_NAME


def use_shared_prompts(policy, on: bool) -> None:
    policy.shared_prompt_ok = on
    policy.lm.config._attn_implementation = ATTENTION_NAME if on else "sdpa"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default="S,M")
    p.add_argument("--dtypes", default="bf16")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--workdir")
    args = p.parse_args()
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="shared_prompt_"))
    workdir.mkdir(parents=True, exist_ok=True)
    build(workdir, args.models.split(","))
    cuda = args.device == "cuda"
    print("| model, dtype | plain rows s | shared prompts s | plain / shared | max log-prob difference |"
          + (" peak GPU GB plain / shared |" if cuda else ""))
    print("|---|---|---|---|---|" + ("---|" if cuda else ""))
    for model in args.models.split(","):
        for dtype in args.dtypes.split(","):
            trainer = posttrain_trainer(workdir, model, dtype, 1, args.device)
            trainer.global_step = 1
            batch, _ = trainer._training_batch({})
            policy = trainer.parts.actor.model
            trainer.parts.actor.compute_log_prob(batch)  # the one-time check of the shared path runs here
            logp = {}
            for on in (False, True):
                use_shared_prompts(policy, on)
                logp[on] = trainer.parts.actor.compute_log_prob(batch)[0]
            times, peak = {False: [], True: []}, {False: 0.0, True: 0.0}
            for _ in range(args.repeats):
                for on in (False, True):
                    use_shared_prompts(policy, on)
                    if cuda:
                        torch.cuda.synchronize()
                        torch.cuda.reset_peak_memory_stats()
                    start = time.perf_counter()
                    trainer.learn(batch)
                    if cuda:
                        torch.cuda.synchronize()
                        peak[on] = max(peak[on], torch.cuda.max_memory_allocated() / 2**30)
                    times[on].append(time.perf_counter() - start)
            plain, shared = statistics.median(times[False]), statistics.median(times[True])
            diff = float((logp[False] - logp[True]).abs().max())
            print(f"| {model} {dtype} | {plain:.2f} | {shared:.2f} | {plain / shared:.2f}x | {diff:.1e} |"
                  + (f" {peak[False]:.2f} / {peak[True]:.2f} |" if cuda else ""), flush=True)


if __name__ == "__main__":
    torch.manual_seed(0)
    main()
