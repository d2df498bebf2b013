"""Multi-turn training end to end on CPU: the small task's SFT model plays the built-in guess_number environment
(it answers with a number and ends its turn; the environment says higher or lower), GRPO trains two steps on the
episodes, validation episodes are logged and `posttrain episodes` prints them."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from posttrain.agents.envs.guess_number import guess_number_rows
from posttrain.config import load_config
from posttrain.trainer.rl import RLTrainer

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def test_grpo_trains_on_guess_number_episodes_and_logs_them(small_task, tmp_path):
    out, _ = small_task
    data = tmp_path / "guess.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in guess_number_rows(8, 1, 9, seed=0, max_guesses=3)))
    run = tmp_path / "run"
    cfg = load_config(None, [
        "algorithm.adv_estimator=grpo", "data.train_batch_size=4", "data.max_prompt_length=160",
        "data.max_response_length=96", "actor_rollout_ref.rollout.n=4", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "actor_rollout_ref.rollout.multi_turn.enable=True", "actor_rollout_ref.rollout.multi_turn.max_assistant_turns=3",
        "actor_rollout_ref.rollout.agent.default_agent_loop=guess_number",
        "actor_rollout_ref.rollout.calculate_log_probs=True", "actor_rollout_ref.model.dtype=fp32",
        "actor_rollout_ref.rollout.dtype=fp32",
        "actor_rollout_ref.model.enable_gradient_checkpointing=False", f"actor_rollout_ref.model.path={out / 'sft'}",
        f"data.train_files={data}", f"data.val_files={data}", "trainer.total_training_steps=2", "trainer.test_freq=2",
        f"trainer.default_local_dir={run}", "trainer.logger=['jsonl']", "trainer.val_before_train=False"])
    RLTrainer(cfg).fit()
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    first = metrics[0]
    assert first["agent/turns/mean"] > 1  # the environment answered and the policy went on
    assert first["response_length/policy_tokens_mean"] < first["response_length/mean"]  # holes in the mask
    assert all(m["actor/pg_loss"] == m["actor/pg_loss"] for m in metrics)  # finite
    assert first["training/rollout_probs_diff_max"] < 1e-4  # fp32 both: the loop's log-probs are the trainer's
    assert "val-agent/turns/mean" in metrics[-1]
    shown = subprocess.run([sys.executable, "-m", "posttrain", "episodes", str(run)], capture_output=True, text=True)
    assert shown.returncode == 0, shown.stderr
    assert "higher" in shown.stdout or "lower" in shown.stdout or "right" in shown.stdout.lower()
