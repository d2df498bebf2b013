"""Measure every algorithm family on the demo task: held-out greedy accuracy before/after and wall time.

    python benchmarks/algorithms.py [--steps 40] [--out runs/bench_algorithms]

Builds (or reuses) the demo's SFT checkpoint, then runs each family from it with the demo's settings and prints a
markdown table (the one in docs/algorithms.md).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from posttrain.config import load_config
from posttrain.tiny.demo import DEMO_RL_OVERRIDES
from posttrain.trainer.rl import RLTrainer

FAMILIES = {
    "PPO (GAE + critic)": ["algorithm.adv_estimator=gae", "critic.optim.lr=1e-4"],
    "GRPO": ["actor_rollout_ref.actor.use_kl_loss=True", "actor_rollout_ref.actor.kl_loss_type=low_var_kl"],
    "Dr. GRPO": ["algorithm.norm_adv_by_std_in_grpo=False", "actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-sum-norm"],
    "GPG": ["algorithm.adv_estimator=gpg", "actor_rollout_ref.actor.policy_loss.loss_mode=gpg"],
    "RLOO": ["algorithm.adv_estimator=rloo", "algorithm.use_kl_in_reward=True"],
    "REINFORCE++": ["algorithm.adv_estimator=reinforce_plus_plus", "algorithm.use_kl_in_reward=True"],
    "ReMax": ["algorithm.adv_estimator=remax", "algorithm.use_kl_in_reward=True"],
    "DAPO": ["algorithm.filter_groups.enable=True", "algorithm.filter_groups.metric=acc",
             "algorithm.filter_groups.max_num_gen_batches=4", "actor_rollout_ref.actor.clip_ratio_high=0.28",
             "reward_model.overlong_buffer.enable=True", "reward_model.overlong_buffer.len=1"],
    "GRPO (grpo_vectorized)": ["algorithm.adv_estimator=grpo_vectorized", "actor_rollout_ref.actor.use_kl_loss=True",
                               "actor_rollout_ref.actor.kl_loss_type=low_var_kl"],
    "GRPO token-sum": ["actor_rollout_ref.actor.loss_agg_mode=token-sum"],
    "Clip-Cov": ["actor_rollout_ref.actor.policy_loss.loss_mode=clip_cov"],
    "KL-Cov": ["actor_rollout_ref.actor.policy_loss.loss_mode=kl_cov"],
    "GMPO": ["actor_rollout_ref.actor.policy_loss.loss_mode=geo_mean"],
    "SAPO": ["actor_rollout_ref.actor.policy_loss.loss_mode=sapo"],
    "DPPO-TV": ["actor_rollout_ref.actor.policy_loss.loss_mode=dppo_tv"],
    "DPPO-KL": ["actor_rollout_ref.actor.policy_loss.loss_mode=dppo_kl"],
    "Optimal token baseline": ["algorithm.adv_estimator=optimal_token_baseline"],
    "GDPO": ["algorithm.adv_estimator=gdpo", "algorithm.gdpo_reward_keys=[score,overlong_penalty]",
             "reward_model.overlong_buffer.enable=True", "reward_model.overlong_buffer.len=1",
             "reward_model.overlong_buffer.log=True"],
    "GRPO + token TIS": ["algorithm.rollout_correction.rollout_is=token"],
    "GRPO + sequence TIS": ["algorithm.rollout_correction.rollout_is=sequence"],
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--out", default="runs/bench_algorithms")
    ap.add_argument("--only", nargs="*", default=None)
    args = ap.parse_args()
    out = Path(args.out)
    if not (out / "sft" / "model.safetensors").is_file():
        from posttrain.tiny.demo import run_demo

        run_demo(str(out), rl_steps=1, quiet=True)  # builds data + SFT checkpoint exactly as the demo does
    rows = []
    for name, overrides in FAMILIES.items():
        if args.only and name not in args.only:
            continue
        run = out / ("run_" + "".join(c for c in name if c.isalnum()))
        cfg = load_config(None, DEMO_RL_OVERRIDES + [
            f"actor_rollout_ref.model.path={out / 'sft'}", f"data.train_files={out / 'data' / 'rl_train.jsonl'}",
            f"data.val_files={out / 'data' / 'test.jsonl'}", f"trainer.total_training_steps={args.steps}",
            f"trainer.test_freq={args.steps}", f"trainer.default_local_dir={run}", "trainer.logger=['jsonl']", *overrides])
        t0 = time.time()
        final = RLTrainer(cfg).fit()
        wall = time.time() - t0
        history = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        key = next(k for k in history[0] if k.startswith("val-core/"))
        rows.append((name, " ".join(o for o in overrides), history[0][key], final[key], args.steps, wall))
        print(f"{name}: {history[0][key]:.1%} -> {final[key]:.1%} in {wall:.0f}s", flush=True)
    print("\n| algorithm | config (on top of the demo's GRPO settings) | accuracy before | after | steps | wall time |")
    print("|---|---|---|---|---|---|")
    for name, overrides, before, after, steps, wall in rows:
        print(f"| {name} | `{overrides}` | {before:.1%} | {after:.1%} | {steps} | {wall:.0f} s |")


if __name__ == "__main__":
    main()
