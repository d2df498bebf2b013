"""Does the demo task learn as well asynchronously as synchronously? Held-out accuracy after the demo's GRPO.

    python benchmarks/async_learning.py [--demo runs/demo_async] [--steps 40] [--seeds 0 1 2] [--only sync async1 ...]

Every run starts from the demo's SFT checkpoint (`posttrain demo`'s own code makes it once if `--demo` has none) and
trains `--steps` GRPO steps with the demo's settings (32 prompts x 8 samples, lr 3e-5, validation every 10 steps:
the demo's held-out greedy accuracy), through `posttrain train` as a user starts it, OMP_NUM_THREADS=1 per process:

- `sync`: one process, generation and training take turns;
- `async0`: two processes (1 generating, 1 training), `staleness_threshold=0`: the groups take turns, so every batch
  is fresh: the asynchronous machinery (transfer, recomputed old log-probs, IS correction) without staleness;
- `async1`, `async4`: two processes, `staleness_threshold` 1 and 4 (the decoupled objective corrects the lag);
- `async4_bypass` (only when named): staleness 4 trained on the behaviour log-probs, no correction.

Wall time is the command's, start-up included; "steps" is the sum of the trainer's step times (validation
excluded). Each run's result is kept in its folder (`result.json`) and read back instead of running again: delete
the folder to measure afresh. Prints the markdown table of docs/algorithms.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from posttrain.tiny.demo import DEMO_RL_OVERRIDES, run_demo

SETTINGS = {
    "sync": ("synchronous, 1 process", []),
    "async0": ("2 processes, staleness_threshold=0", ["rollout.n_gpus_per_node=1",
                                                      "async_training.staleness_threshold=0"]),
    "async1": ("asynchronous, staleness_threshold=1", ["rollout.n_gpus_per_node=1",
                                                       "async_training.staleness_threshold=1"]),
    "async4": ("asynchronous, staleness_threshold=4", ["rollout.n_gpus_per_node=1",
                                                       "async_training.staleness_threshold=4"]),
    "async4_bypass": ("staleness_threshold=4 without the correction (`bypass_mode=True`)",
                      ["rollout.n_gpus_per_node=1", "async_training.staleness_threshold=4",
                       "algorithm.rollout_correction.bypass_mode=True"]),
}


def sft_of(demo: Path) -> Path:
    """The demo's SFT checkpoint (runs the demo once if it is not there)."""
    if not (demo / "sft" / "config.json").is_file():
        run_demo(str(demo), quiet=True)
    return demo / "sft"


def run(demo: Path, setting: str, steps: int, seed: int) -> dict:
    out = demo / "async_learning" / f"{setting}_seed{seed}"
    if (out / "result.json").is_file():  # measured already: the table of all seeds without running them again
        return json.loads((out / "result.json").read_text())
    args = DEMO_RL_OVERRIDES + [
        f"actor_rollout_ref.model.path={sft_of(demo)}", f"data.train_files={demo / 'data' / 'rl_train.jsonl'}",
        f"data.val_files={demo / 'data' / 'test.jsonl'}", f"trainer.total_training_steps={steps}",
        f"trainer.seed={seed}", f"data.seed={seed}", f"trainer.default_local_dir={out}",
        "trainer.logger=['jsonl']", "trainer.save_freq=-1", *SETTINGS[setting][1]]
    t0 = time.time()
    done = subprocess.run([sys.executable, "-m", "posttrain.cli", "train", *args], capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    wall = time.time() - t0
    if done.returncode != 0:
        raise SystemExit(f"{setting} seed {seed} failed:\n{done.stderr[-3000:]}")
    history = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    key = next(k for k in history[0] if k.startswith("val-core/"))
    result = {"before": history[0][key], "after": [h for h in history if key in h][-1][key], "wall_s": wall,
              "step_s": sum(h.get("timing_s/step", 0.0) for h in history),
              "staleness_mean": statistics.mean(h.get("async/staleness_mean", 0.0) for h in history[1:])}
    (out / "result.json").write_text(json.dumps(result))
    return result


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--demo", default="runs/demo_async")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--seeds", type=int, nargs="*", default=[0, 1, 2])
    ap.add_argument("--only", nargs="*", default=["sync", "async0", "async1", "async4"], choices=list(SETTINGS))
    args = ap.parse_args()
    demo = Path(args.demo)
    results: dict[str, list[dict]] = {}
    for seed in args.seeds:
        for setting in args.only:
            r = run(demo, setting, args.steps, seed)
            results.setdefault(setting, []).append(r)
            print(json.dumps({"setting": setting, "seed": seed} | r), flush=True)
    base = results.get("sync")
    print(f"\nseeds {args.seeds}, {args.steps} steps; before training (the SFT checkpoint): "
          f"{next(iter(results.values()))[0]['before']:.1%}\n")
    print("| setting | held-out accuracy, seeds " + " / ".join(map(str, args.seeds)) + " | mean | vs synchronous "
          "(points) | mean staleness | wall time per run (steps alone) |")
    print("|---|---|---|---|---|---|")
    for setting, rows in results.items():
        mean = statistics.mean(r["after"] for r in rows)
        diff = f"{100 * (mean - statistics.mean(r['after'] for r in base)):+.1f}" if base and setting != "sync" else ""
        print(f"| {SETTINGS[setting][0]} | " + " / ".join(f"{r['after']:.1%}" for r in rows) + f" | {mean:.1%} | "
              f"{diff} | {statistics.mean(r['staleness_mean'] for r in rows):.2f} | "
              f"{statistics.mean(r['wall_s'] for r in rows):.0f} s "
              f"({statistics.mean(r['step_s'] for r in rows):.0f} s) |")


if __name__ == "__main__":
    main()
