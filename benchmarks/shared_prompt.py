"""The training side of one GRPO step with and without computing each prompt once, side by side.

    python benchmarks/shared_prompt.py [--models S,M] [--dtypes bf16] [--repeats 3] [--device cpu|cuda]
                                       [--workdir DIR]

The workload of benchmarks/grpo_step.py (16 GSM8K prompts x 8 responses of 64 tokens, Dr. GRPO, one optimizer step):
one batch is generated, then `RLTrainer.learn` runs on it alternately with plain `prompt || response` rows and with
shared prompts (models/shared_prompt.py), and with shared prompts and packed rows (`use_remove_padding`,
models/packed.py), `--repeats` times each, in one process. Prints the median seconds and the ratios, the largest
log-prob difference between the paths on that batch, and on `--device cuda` the peak GPU memory of each path's
`learn`.
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


PATHS = ("plain", "shared", "packed")  # padded rows; padded rows, prompts shared; packed rows, prompts shared


def use_path(actor, path: str) -> None:
    policy = actor.model
    policy.shared_prompt_ok = path != "plain"
    actor.runner.remove_padding = policy.packed_ok = path == "packed"
    policy.lm.config._attn_implementation = ATTENTION_NAME if path != "plain" else "sdpa"


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
    print("| model, dtype | plain rows s | shared prompts s | packed + shared s | plain / shared | shared / packed "
          "| max log-prob difference |" + (" peak GPU GB plain / shared / packed |" if cuda else ""))
    print("|---|---|---|---|---|---|---|" + ("---|" if cuda else ""))
    for model in args.models.split(","):
        for dtype in args.dtypes.split(","):
            trainer = posttrain_trainer(workdir, model, dtype, 1, args.device)
            trainer.global_step = 1
            batch, _ = trainer._training_batch({})
            actor = trainer.parts.actor
            actor.compute_log_prob(batch)  # the one-time checks run here
            logp = {}
            for path in PATHS:
                use_path(actor, path)
                logp[path] = actor.compute_log_prob(batch)[0]
            times, peak = {path: [] for path in PATHS}, {path: 0.0 for path in PATHS}
            for _ in range(args.repeats):
                for path in PATHS:
                    use_path(actor, path)
                    if cuda:
                        torch.cuda.synchronize()
                        torch.cuda.reset_peak_memory_stats()
                    start = time.perf_counter()
                    trainer.learn(batch)
                    if cuda:
                        torch.cuda.synchronize()
                        peak[path] = max(peak[path], torch.cuda.max_memory_allocated() / 2**30)
                    times[path].append(time.perf_counter() - start)
            plain, shared, packed = (statistics.median(times[path]) for path in PATHS)
            diff = max(float((logp["plain"] - logp[path]).abs().max()) for path in PATHS)
            print(f"| {model} {dtype} | {plain:.2f} | {shared:.2f} | {packed:.2f} | {plain / shared:.2f}x | "
                  f"{shared / packed:.2f}x | {diff:.1e} |"
                  + (" " + " / ".join(f"{peak[path]:.2f}" for path in PATHS) + " |" if cuda else ""), flush=True)


if __name__ == "__main__":
    torch.manual_seed(0)
    main()
