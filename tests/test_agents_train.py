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


@pytest.fixture(scope="module")
def guess_run(small_task, tmp_path_factory):
    """GRPO for 2 steps on guess_number episodes from the small task's SFT model, validated and saved at step 2.
    Returns (run folder, data file)."""
    out, _ = small_task
    tmp_path = tmp_path_factory.mktemp("guess_run")
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
        "trainer.save_freq=2", f"trainer.default_local_dir={run}", "trainer.logger=['jsonl']",
        "trainer.val_before_train=False"])
    RLTrainer(cfg).fit()
    return run, data


def test_grpo_trains_on_guess_number_episodes_and_logs_them(guess_run):
    run, _ = guess_run
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


def test_eval_of_a_multi_turn_run_plays_its_episodes_as_its_validation_did(guess_run, tmp_path, capsys):
    """`posttrain eval` of a run that trained on episodes runs episodes with the run's agent settings: greedy, with
    the run's response budget, its accuracy and every val-agent/* metric are the ones the run's last validation
    logged, and each sample carries its conversation; --no-multi-turn gives single responses."""
    from posttrain.cli import main

    run, data = guess_run
    logged = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()][-1]
    out = tmp_path / "eval.jsonl"
    args = ["eval", str(run), "--data", str(data), "--max-new-tokens", "96", "--max-prompt-length", "160",
            "--num-workers", "0", "-o"]
    assert main(args + [str(out)]) == 0
    metrics = json.loads(out.with_name("eval.metrics.json").read_text())["metrics"]
    agent = {k: v for k, v in logged.items() if k.startswith("val-agent/")}
    assert agent and {k: metrics[k] for k in agent} == pytest.approx(agent)
    assert metrics["val-core/guess_number/acc/mean@1"] == pytest.approx(logged["val-core/guess_number/acc/mean@1"])
    assert "episodes: turns/mean=" in capsys.readouterr().out
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 8 and sum(r["turns"] for r in rows) / 8 == pytest.approx(agent["val-agent/turns/mean"])
    for r in rows:  # the conversation: the prompt, then turns the environment answered as the user
        assert [m["role"] for m in r["messages"]].count("assistant") == r["turns"]
        assert r["messages"][-1]["role"] in ("assistant", "user")
    assert any(r["turns"] > 1 for r in rows)  # the environment answered and the policy went on

    single = tmp_path / "single.jsonl"
    assert main(args + [str(single), "--no-multi-turn"]) == 0
    single_metrics = json.loads(single.with_name("single.metrics.json").read_text())["metrics"]
    assert not any(k.startswith("val-agent/") for k in single_metrics)
    assert "messages" not in json.loads(single.read_text().splitlines()[0])
    assert main(args + [str(single), "--agent", "no_such_env"]) == 2
    assert "--agent='no_such_env': no such environment (registered: " in capsys.readouterr().err
    (tmp_path / "tools.py").write_text("def plain(a: int) -> int:\n    return a\n")
    assert main(args + [str(single), "--function-tools", str(tmp_path / "tools.py")]) == 2
    assert "defines no tool" in capsys.readouterr().err
