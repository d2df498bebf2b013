"""GRPO step time in one process and in several gloo processes on the same machine, side by side.

    python benchmarks/processes.py --workdir /tmp/procs [--nproc 2] [--steps 12] [--repeats 2]

Builds the tiny offline model and the synthetic addition task (44 prompts x 8 samples x 8 tokens per step, fp32, no
gradient checkpointing: the settings of tests/test_distributed_cli.py), runs `posttrain train` alternately with 1 and
`--nproc` processes, and prints the median `timing_s/step` and `timing_s/update_actor` after two warm-up steps.
`--code DIR` runs another checkout (for before/after comparisons of a change).
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

ROOT = Path(__file__).resolve().parents[1]


def prepare(workdir: Path) -> tuple[Path, Path]:
    sys.path.insert(0, str(ROOT))
    from posttrain.data.synthetic import tokenizer_corpus, write_task
    from posttrain.models.tiny import build_tiny_model

    model = workdir / "model"
    if not (model / "config.json").exists():
        build_tiny_model(model, tokenizer_corpus(0, 500), seed=0)
    files = write_task(workdir / "task", seed=0, operands=range(0, 10), held_out=0, dev=10, copies=8)
    return model, files["rl_train"]


def run(code: Path, model: Path, data: Path, run_dir: Path, nproc: int, steps: int) -> tuple[float, float]:
    shutil.rmtree(run_dir, ignore_errors=True)
    args = ["algorithm.adv_estimator=grpo", "data.train_batch_size=44", "data.max_prompt_length=32",
            "data.max_response_length=8", "actor_rollout_ref.rollout.n=8",
            "actor_rollout_ref.actor.ppo_mini_batch_size=44",
            "actor_rollout_ref.actor.optim.lr=3e-4", "actor_rollout_ref.model.enable_gradient_checkpointing=False",
            "actor_rollout_ref.model.dtype=fp32", "actor_rollout_ref.rollout.dtype=fp32",
            f"actor_rollout_ref.model.path={model}", f"data.train_files={data}", f"trainer.default_local_dir={run_dir}",
            "trainer.logger=['jsonl']", "trainer.val_before_train=False", f"trainer.total_training_steps={steps}",
            f"trainer.n_gpus_per_node={nproc}"]
    env = {**os.environ, "PYTHONPATH": str(code)}
    out = subprocess.run([sys.executable, "-m", "posttrain", "train", *args], env=env, capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(out.stderr[-3000:])
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()][2:]
    return (statistics.median(r["timing_s/step"] for r in rows),
            statistics.median(r["timing_s/update_actor"] for r in rows))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workdir", type=Path, required=True)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--code", type=Path, default=ROOT, help="checkout to run (default: this one)")
    a = p.parse_args()
    a.workdir.mkdir(parents=True, exist_ok=True)
    model, data = prepare(a.workdir)
    results: dict[int, list] = {1: [], a.nproc: []}
    for _ in range(a.repeats):
        for nproc in (1, a.nproc):
            results[nproc].append(run(a.code, model, data, a.workdir / f"run{nproc}", nproc, a.steps))
    print(f"code {a.code}; median of {a.repeats} runs x {a.steps - 2} steps")
    print("| processes | s/step | actor update s |\n|---|---|---|")
    for nproc, rs in results.items():
        print(f"| {nproc} | {statistics.median(r[0] for r in rs):.3f} | {statistics.median(r[1] for r in rs):.3f} |")
    one, many = (statistics.median(r[0] for r in results[n]) for n in (1, a.nproc))
    print(f"step time, {a.nproc} processes / 1: {many / one:.2f}x")


if __name__ == "__main__":
    main()
