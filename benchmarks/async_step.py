"""Asynchronous RL on this machine: weight-sync cost, and synchronous vs one-step-off-policy steps per minute.

    python benchmarks/async_step.py --workdir /tmp/async [--steps 6] [--sync-mb 256] [--skip-runs]

1. Weight sync: two gloo processes; rank 0 pushes `--sync-mb` MB of float32 tensors (in 512 MB buckets) five
   times; prints seconds per GB (the median push).
2. Steps per minute: the tiny offline model and the synthetic addition task, `posttrain train` with one generating
   and one training process (OMP_NUM_THREADS=1 each), first with `async_training.staleness_threshold=0` (the groups
   take turns: synchronous), then with 1 (one-step-off-policy: step k+1 generates while step k trains). The
   workload is sized so that generation (4 prompts x 4 responses x 96 tokens: decoding steps dominate) and
   training (one epoch over them) take similar time. Steps per minute from the trainer's step times after the first step (start-up excluded).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

from processes import prepare  # the same tiny model and task as the process-count benchmark

ROOT = Path(__file__).resolve().parents[1]
RESPONSE = 96  # generated tokens per response (ignore_eos: every response this long)
PROMPTS = 4  # prompts per step (x 4 responses): few long responses, so decoding steps weigh as much as training

SYNC_SCRIPT = """
import statistics, sys, torch
from posttrain.parallel.context import exit_process, shutdown
from posttrain.parallel.groups import join
from posttrain.parallel.weight_sync import WeightSync
mb = int(sys.argv[1])
groups = join(device_name="cpu", timeout_s=600)
tensors = {f"w{i}": torch.randn(mb << 16) for i in range(4)}  # 4 tensors of mb/4 MB
sync = WeightSync(tensors, src=0)
times = []
for version in range(1, 6):
    if groups.trains:
        sync.push(version)
    else:
        sync.receive()
    times.append(sync.seconds)
if groups.trains:
    print(f"weight sync (gloo, 2 processes): {sync.total_bytes / 2**20:.0f} MB per push, median "
          f"{statistics.median(times):.3f} s = {statistics.median(times) / (sync.total_bytes / 2**30):.2f} s/GB")
shutdown()
exit_process(0)
"""


def weight_sync(workdir: Path, mb: int) -> None:
    script = workdir / "sync.py"
    script.write_text(SYNC_SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                          str(script), str(mb)], env=env, capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(out.stderr[-3000:])
    print(out.stdout.strip())


def run(model: Path, data: Path, run_dir: Path, staleness: int, steps: int, epochs: int) -> list[dict]:
    shutil.rmtree(run_dir, ignore_errors=True)
    args = ["algorithm.adv_estimator=grpo", f"data.train_batch_size={PROMPTS}", "data.max_prompt_length=32",
            f"data.max_response_length={RESPONSE}", "actor_rollout_ref.rollout.n=4",
            "actor_rollout_ref.rollout.ignore_eos=True",
            f"actor_rollout_ref.actor.ppo_mini_batch_size={PROMPTS}", f"actor_rollout_ref.actor.ppo_epochs={epochs}",
            "actor_rollout_ref.actor.optim.lr=3e-4", "actor_rollout_ref.model.enable_gradient_checkpointing=False",
            "actor_rollout_ref.model.dtype=fp32", "actor_rollout_ref.rollout.dtype=fp32", "trainer.device=cpu",
            f"actor_rollout_ref.model.path={model}", f"data.train_files={data}", f"trainer.default_local_dir={run_dir}",
            "trainer.logger=['jsonl']", "trainer.val_before_train=False", f"trainer.total_training_steps={steps}",
            "reward_model.num_workers=0", "rollout.n_gpus_per_node=1",
            f"async_training.staleness_threshold={staleness}"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-m", "posttrain", "train", *args], env=env, capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(out.stderr[-3000:])
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workdir", type=Path, required=True)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--epochs", type=int, default=1, help="actor ppo_epochs: sizes training against generation")
    p.add_argument("--sync-mb", type=int, default=256)
    p.add_argument("--skip-runs", action="store_true", help="only the weight-sync measurement")
    args = p.parse_args()
    args.workdir.mkdir(parents=True, exist_ok=True)
    weight_sync(args.workdir, args.sync_mb)
    if args.skip_runs:
        return
    model, data = prepare(args.workdir)
    per_minute = {}
    print(f"{'mode':<22}{'steps/min':>10}{'gen s':>8}{'train s':>9}{'trainer idle':>14}{'staleness':>11}")
    for name, staleness in (("synchronous (0)", 0), ("one-step-off (1)", 1)):
        rows = run(model, data, args.workdir / f"run{staleness}", staleness, args.steps, args.epochs)[1:]
        step = statistics.median(r["timing_s/step"] for r in rows)
        per_minute[name] = 60 / step
        gen = statistics.median(r["timing_s/gen"] + r.get("timing_s/reward", 0.0) for r in rows)
        train = statistics.median(r["timing_s/step"] - r["timing_s/wait_gen"] for r in rows)
        idle = statistics.median(r["async/train_idle_share"] for r in rows)
        stale = statistics.mean(r["async/staleness_mean"] for r in rows)
        print(f"{name:<22}{60 / step:>10.2f}{gen:>8.2f}{train:>9.2f}{idle:>14.2f}{stale:>11.2f}")
    a, b = per_minute.values()
    print(f"one-step-off / synchronous: {b / a:.2f}x")


if __name__ == "__main__":
    main()
