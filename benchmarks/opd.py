"""On-policy distillation against GRPO on the demo task, at equal steps and at equal training time.

    python benchmarks/opd.py [--demo runs/demo_opd] [--steps 20] [--seeds 0 1 2]

The teacher is the demo's GRPO-trained policy (`posttrain demo`, 40 steps, exported as a Hugging Face folder), the
student the demo's SFT checkpoint it started from. Each method trains the student for `--steps` steps with the
demo's settings (32 prompts x 8 samples, lr 3e-5) and validates every 5 steps (held-out greedy accuracy). "At
GRPO's time": the accuracy at the last validation whose summed step times (rollout, teacher, update; validation
excluded) fit in GRPO's for `--steps` steps. Prints the markdown table of docs/algorithms.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from posttrain.config import load_config
from posttrain.tiny.demo import DEMO_RL_OVERRIDES, run_demo
from posttrain.trainer.rl import RLTrainer

OPD = ["distillation.enabled=True", "distillation.distillation_loss.use_task_rewards=False"]
METHODS = {
    "GRPO (task reward)": [],
    "OPD, k1 reward (PG)": OPD + ["distillation.distillation_loss.loss_mode=k1",
                                  "distillation.distillation_loss.use_policy_gradient=True"],
    "OPD, top-k forward KL (k=8)": OPD + ["distillation.distillation_loss.loss_mode=forward_kl_topk",
                                          "distillation.distillation_loss.topk=8"],
    "OPD, k3 loss": OPD + ["distillation.distillation_loss.loss_mode=k3"],
}


def teacher_of(demo: Path) -> Path:
    """The demo's GRPO-trained policy as a Hugging Face folder (runs the demo once if it is not there)."""
    path = demo / "rl" / "global_step_40" / "actor" / "huggingface"
    if not (path / "config.json").is_file():
        run_demo(str(demo), quiet=True, extra_overrides=[
            "actor_rollout_ref.actor.checkpoint.save_contents=[model,optimizer,extra,hf_model]"])
        from posttrain.trainer.checkpoint import finish_exports

        finish_exports()
    return path


def run(demo: Path, name: str, overrides: list[str], steps: int, seed: int) -> list[dict]:
    out = demo / "opd" / f"{''.join(c for c in name if c.isalnum())}_seed{seed}"
    cfg = load_config(None, DEMO_RL_OVERRIDES + [
        f"actor_rollout_ref.model.path={demo / 'sft'}", f"data.train_files={demo / 'data' / 'rl_train.jsonl'}",
        f"data.val_files={demo / 'data' / 'test.jsonl'}", f"trainer.total_training_steps={steps}",
        "trainer.test_freq=5", f"trainer.seed={seed}", f"data.seed={seed}", f"trainer.default_local_dir={out}",
        "trainer.logger=['jsonl']", "trainer.save_freq=-1",
        f"distillation.teacher_models.teacher_model.model_path={teacher_of(demo)}", *overrides])
    RLTrainer(cfg).fit()
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def curve(history: list[dict]) -> list[tuple[int, float, float]]:
    """(step, summed step seconds so far, held-out accuracy) at each validation."""
    key = next(k for k in history[0] if k.startswith("val-core/"))
    points, spent = [], 0.0
    for h in history:
        spent += h.get("timing_s/step", 0.0)
        if key in h:
            points.append((h["step"], spent, h[key]))
    return points


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--demo", default="runs/demo_opd")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--seeds", type=int, nargs="*", default=[0])
    ap.add_argument("--only", nargs="*", default=None)
    args = ap.parse_args()
    demo = Path(args.demo)
    teacher_of(demo)  # once, before the runs
    results: dict[str, list] = {}
    for seed in args.seeds:
        grpo_time = None
        for name, overrides in METHODS.items():
            if args.only and name not in args.only and not name.startswith("GRPO"):
                continue
            points = curve(run(demo, name, overrides, args.steps, seed))
            if grpo_time is None:
                grpo_time = points[-1][1]
            fits = [p for p in points if p[1] <= grpo_time * 1.0001] or points[:1]
            row = (points[0][2], points[-1][2], points[-1][1], fits[-1][2], fits[-1][0])
            results.setdefault(name, []).append(row)
            print(f"seed {seed} {name}: {row[0]:.1%} -> {row[1]:.1%} in {row[2]:.0f} s; at GRPO's time "
                  f"{row[3]:.1%} (step {row[4]})", flush=True)
    teacher_acc = curve([json.loads(x) for x in (demo / "rl" / "metrics.jsonl").read_text().splitlines()])[-1][2]
    print(f"\nteacher (the demo's policy after 40 GRPO steps): {teacher_acc:.1%}; seeds {args.seeds}\n")
    print(f"| method | config (on top of the demo's settings) | before | after {args.steps} steps | "
          "training time | at GRPO's training time (step) |")
    print("|---|---|---|---|---|---|")
    for name, rows in results.items():
        mean = [statistics.mean(r[i] for r in rows) for i in range(5)]
        each = " / ".join(f"{r[1]:.1%}" for r in rows)
        at = " / ".join(f"{r[3]:.1%} ({r[4]})" for r in rows)
        config = " ".join(o for o in METHODS[name] if "teacher_models" not in o) or "(the demo's GRPO)"
        print(f"| {name} | `{config}` | {mean[0]:.1%} | {mean[1]:.1%} ({each}) | {mean[2]:.0f} s | "
              f"{mean[3]:.1%} ({at}) |")


if __name__ == "__main__":
    main()
