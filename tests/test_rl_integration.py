"""End to end on CPU: seeded runs repeat exactly, a stopped run resumes where it stopped, the usual GSM8K command
line runs and checkpoints. (Learning per algorithm family: test_learning.py.)"""

import json
import subprocess
import sys

import pytest

from posttrain.config import load_config
from posttrain.trainer.rl import RLTrainer

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def rl_config(out, files, run, steps, *extra):
    return load_config(None, [
        "algorithm.adv_estimator=grpo", "data.train_batch_size=45", "data.max_prompt_length=32",
        "data.max_response_length=8", "actor_rollout_ref.rollout.n=8", "actor_rollout_ref.actor.ppo_mini_batch_size=45",
        "actor_rollout_ref.actor.optim.lr=3e-4", "actor_rollout_ref.model.enable_gradient_checkpointing=False",
        f"actor_rollout_ref.model.path={out / 'sft'}", f"data.train_files={files['rl_train']}",
        f"trainer.total_training_steps={steps}", f"trainer.default_local_dir={out / run}", "trainer.logger=['jsonl']",
        "trainer.val_before_train=False", *extra])


def read_metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_same_seed_same_numbers(small_task):
    out, files = small_task
    runs = []
    for name in ("det_a", "det_b"):
        RLTrainer(rl_config(out, files, name, 2)).fit()
        runs.append([{k: v for k, v in m.items() if not k.startswith(("timing_s", "perf"))}
                     for m in read_metrics(out / name)])
    assert runs[0] == runs[1]


@pytest.mark.parametrize("algo", [[], ["algorithm.adv_estimator=gae", "algorithm.kl_ctrl.type=adaptive",
                                          "algorithm.use_kl_in_reward=True"]], ids=["grpo", "ppo_adaptive_kl"])
def test_resume_continues_from_the_last_checkpoint(small_task, algo):
    out, files = small_task
    name = "resume_" + ("ppo" if algo else "grpo")
    RLTrainer(rl_config(out, files, name, 2, "trainer.save_freq=1", *algo)).fit()
    step2 = out / name / "global_step_2"
    assert (step2 / "actor" / "model.safetensors").is_file() and (step2 / "actor_optim.pt").is_file()
    if algo:
        assert (step2 / "critic" / "value_head.safetensors").is_file() and (step2 / "critic_optim.pt").is_file()
    (out / name / ".tmp_global_step_3").mkdir()  # debris of a run killed while saving is ignored
    RLTrainer(rl_config(out, files, name, 3, "trainer.save_freq=1", *algo)).fit()
    assert [m["step"] for m in read_metrics(out / name)] == [1, 2, 3]
    # and the uninterrupted run gives the same step-3 numbers (critic, KL coefficient and data order included)
    RLTrainer(rl_config(out, files, name + "_straight", 3, *algo)).fit()
    strip = lambda m: {k: round(v, 4) for k, v in m.items() if not k.startswith(("timing_s", "perf"))}
    assert strip(read_metrics(out / name)[-1]) == strip(read_metrics(out / (name + "_straight"))[-1])


def test_recipes_load_by_name():
    for name in ("ppo", "grpo", "dr_grpo", "gpg", "dapo", "rloo", "reinforce_plus_plus", "remax"):
        cfg = load_config(name, ["data.train_batch_size=8", "actor_rollout_ref.actor.ppo_mini_batch_size=4"])
        assert cfg.algorithm.adv_estimator
    assert load_config("dr_grpo").actor_rollout_ref.actor.loss_agg_mode == "seq-mean-token-sum-norm"
    assert load_config("dapo").algorithm.filter_groups.enable


def test_gsm8k_command_line_runs_and_checkpoints(tmp_path, tiny_model_dir):
    from tests.conftest import SHARED_DATA

    if not (SHARED_DATA / "gsm8k").is_dir():
        pytest.skip(f"shared data not found at {SHARED_DATA}")
    subprocess.run([sys.executable, "-m", "posttrain.cli", "prepare", "gsm8k", "--output-dir", str(tmp_path / "gsm8k")],
                   check=True, capture_output=True)
    run = tmp_path / "run"
    import pyarrow.parquet as pq

    # validation on the full test split would be slow; eight of its rows keep the check short
    pq.write_table(pq.read_table(tmp_path / "gsm8k" / "test.parquet").slice(0, 8), tmp_path / "val.parquet")
    cmd = [sys.executable, "-m", "posttrain.cli", "train", "algorithm.adv_estimator=grpo",
           f"data.train_files={tmp_path / 'gsm8k' / 'test.parquet'}", f"data.val_files={tmp_path / 'val.parquet'}",
           "data.train_batch_size=4", "data.val_batch_size=8", "data.max_prompt_length=384", "data.max_response_length=8",
           "data.filter_overlong_prompts=True", f"actor_rollout_ref.model.path={tiny_model_dir}",
           "actor_rollout_ref.actor.optim.lr=1e-6", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
           "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4", "actor_rollout_ref.rollout.n=4",
           "actor_rollout_ref.actor.use_kl_loss=True", "actor_rollout_ref.actor.kl_loss_coef=0.001",
           "actor_rollout_ref.actor.kl_loss_type=low_var_kl", "actor_rollout_ref.rollout.name=vllm",
           "actor_rollout_ref.rollout.gpu_memory_utilization=0.6", "trainer.logger=['console','tensorboard']",
           "trainer.total_training_steps=2", "trainer.save_freq=2", "trainer.test_freq=2", "trainer.val_before_train=False",
           f"trainer.default_local_dir={run}"]
    result = subprocess.run(cmd, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "note: actor_rollout_ref.rollout.name=vllm" in result.stderr
    metrics = read_metrics(run)
    assert [m["step"] for m in metrics] == [1, 2]
    for key in ("actor/pg_loss", "actor/kl_loss", "actor/entropy", "actor/grad_norm", "actor/lr", "actor/pg_clipfrac",
                "actor/ppo_kl", "critic/score/mean", "critic/advantages/mean", "response_length/mean",
                "prompt_length/mean", "timing_s/gen", "timing_s/ref", "timing_s/update_actor", "perf/throughput",
                "batch/zero_std_group_frac", "val-core/openai/gsm8k/acc/mean@1"):
        assert key in metrics[-1], key
    assert (run / "global_step_2" / "actor" / "model.safetensors").is_file()
    assert (run / "config.yaml").is_file() and list((run / "tensorboard").iterdir())


def test_start_as_several_processes_is_refused(monkeypatch, tiny_model_dir):
    from posttrain.config import ConfigError
    from posttrain.trainer.rl import preflight

    cfg = load_config(None, [f"actor_rollout_ref.model.path={tiny_model_dir}", "data.train_files=x.jsonl"])
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match="more than one process is not available yet"):
        preflight(cfg)
