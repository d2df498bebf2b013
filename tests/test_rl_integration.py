"""End to end on CPU: seeded runs repeat exactly, a stopped run resumes where it stopped, the usual GSM8K command
line runs and checkpoints. (Learning per algorithm family: test_learning.py.)"""

import json
import subprocess
import sys

import pytest
import torch

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


SHUFFLED_MINI_BATCHES = ["actor_rollout_ref.actor.shuffle=True", "actor_rollout_ref.actor.ppo_mini_batch_size=15"]


@pytest.mark.parametrize("algo", [[], SHUFFLED_MINI_BATCHES,
                                  ["algorithm.adv_estimator=gae", "algorithm.kl_ctrl.type=adaptive",
                                   "algorithm.use_kl_in_reward=True", "critic.shuffle=True", *SHUFFLED_MINI_BATCHES]],
                         ids=["grpo", "grpo_shuffled", "ppo_adaptive_kl_shuffled"])
def test_resume_continues_from_the_last_checkpoint(small_task, algo, request):
    out, files = small_task
    name = "resume_" + request.node.callspec.id
    RLTrainer(rl_config(out, files, name, 2, "trainer.save_freq=1", *algo)).fit()
    step2 = out / name / "global_step_2"
    assert (step2 / "actor" / ".metadata").is_file() and (step2 / "actor_state.pt").is_file()
    if "algorithm.adv_estimator=gae" in algo:
        assert (step2 / "critic" / ".metadata").is_file() and (step2 / "critic_state.pt").is_file()
    (out / name / ".tmp_global_step_3").mkdir()  # debris of a run killed while saving is ignored
    resumed = RLTrainer(rl_config(out, files, name, 3, "trainer.save_freq=1", *algo))
    resumed.fit()
    assert [m["step"] for m in read_metrics(out / name)] == [1, 2, 3]
    # and the uninterrupted run gives the same step-3 numbers (critic, KL coefficient and data order included)
    RLTrainer(rl_config(out, files, name + "_straight", 3, *algo)).fit()
    strip = lambda m: {k: round(v, 4) for k, v in m.items() if not k.startswith(("timing_s", "perf"))}
    assert strip(read_metrics(out / name)[-1]) == strip(read_metrics(out / (name + "_straight"))[-1])
    if resumed.parts.critic is not None:  # the critic exports as a plain backbone folder plus its value head
        from posttrain.models.policy import ValueModel
        from posttrain.trainer.export import export_checkpoint

        exported = ValueModel.from_pretrained(str(export_checkpoint(out / name / "global_step_3",
                                                                    out / name / "critic_hf", role="critic")))
        ids, mask = torch.tensor([[1, 5, 9, 13]]), torch.ones(1, 4, dtype=torch.long)
        with torch.no_grad():
            assert torch.allclose(exported(ids, mask), resumed.parts.critic.model(ids, mask), atol=1e-5)


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
           "actor_rollout_ref.actor.kl_loss_type=low_var_kl", "actor_rollout_ref.rollout.name=posttrain",
           "actor_rollout_ref.rollout.gpu_memory_utilization=0.6", "trainer.logger=['console','tensorboard']",
           "trainer.total_training_steps=2", "trainer.save_freq=2", "trainer.test_freq=2", "trainer.val_before_train=False",
           f"trainer.default_local_dir={run}"]
    result = subprocess.run(cmd, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]
    # a vLLM key on posttrain's engine acts nowhere: a note says so (vLLM's own run: tests/test_vllm_train.py)
    assert "actor_rollout_ref.rollout.gpu_memory_utilization: keys of the vLLM engine" in result.stderr
    metrics = read_metrics(run)
    assert [m["step"] for m in metrics] == [1, 2]
    for key in ("actor/pg_loss", "actor/kl_loss", "actor/entropy", "actor/grad_norm", "actor/lr", "actor/pg_clipfrac",
                "actor/ppo_kl", "critic/score/mean", "critic/advantages/mean", "response_length/mean",
                "prompt_length/mean", "timing_s/gen", "timing_s/ref", "timing_s/update_actor", "perf/throughput",
                "batch/zero_std_group_frac", "val-core/openai/gsm8k/acc/mean@1"):
        assert key in metrics[-1], key
    assert (run / "global_step_2" / "actor" / ".metadata").is_file()
    assert (run / "config.yaml").is_file() and list((run / "tensorboard").iterdir())


def test_resume_restores_skipped_steps(small_task):
    out, files = small_task
    cfg = rl_config(out, files, "resume_skipped", 2)
    trainer = RLTrainer(cfg)
    trainer.global_step, trainer.parts.actor.skipped_steps = 1, 3
    trainer.save()
    resumed = RLTrainer(cfg)
    resumed._maybe_resume()
    assert resumed.global_step == 1 and resumed.parts.actor.skipped_steps == 3


def test_val_only_validates_and_stops_from_a_checkpoint_too(small_task):
    from posttrain.config import ConfigError

    out, files = small_task
    with pytest.raises(ConfigError, match="val_only=True validates and stops, so it needs data.val_files"):
        rl_config(out, files, "val_only", 2, "trainer.val_only=True")
    run = "val_only"
    RLTrainer(rl_config(out, files, run, 1, "trainer.save_freq=1")).fit()
    shards = sorted((out / run / "global_step_1" / "actor").glob("*.distcp"))
    before = [p.read_bytes() for p in shards]
    val = RLTrainer(rl_config(out, files, run, 3, "trainer.val_only=True", f"data.val_files={files['rl_train']}",
                              "data.val_batch_size=45")).fit()
    assert any(k.startswith("val-core/") for k in val)
    assert [m["step"] for m in read_metrics(out / run)] == [1, 1]  # the step-1 training line, then the validation
    assert not (out / run / "global_step_2").exists()
    assert [p.read_bytes() for p in shards] == before


def test_log_prob_passes_run_without_dropout(small_task):
    """With dropout in the model config, old log-probs computed after an update (the model left in train mode)
    are still deterministic: the pass runs in eval mode, so the first PPO ratio of a step is exactly 1."""
    out, files = small_task
    trainer = RLTrainer(rl_config(out, files, "dropout", 2, "+actor_rollout_ref.model.override_config.attention_dropout=0.5",
                                  "actor_rollout_ref.actor.ppo_mini_batch_size=15"))
    trainer.global_step = 1
    trainer.train_step()
    assert trainer.parts.actor.model.training  # the update trains with dropout, as the config asks
    batch, _ = trainer._training_batch({})
    first, _ = trainer.parts.actor.compute_log_prob(batch)
    second, _ = trainer.parts.actor.compute_log_prob(batch)
    assert torch.equal(first, second)


def test_lora_checkpoint_exports_merged_weights(small_task, tmp_path):
    """A LoRA run's checkpoint exports to a plain folder whose model computes what the adapted policy computes."""
    from transformers import AutoModelForCausalLM

    from posttrain.trainer.export import export_checkpoint

    out, files = small_task
    trainer = RLTrainer(rl_config(out, files, "lora_export", 2, "trainer.save_freq=2",
                                  "actor_rollout_ref.model.lora_rank=4", "actor_rollout_ref.actor.optim.lr=1e-2"))
    trainer.fit()
    trainable = sum(p.numel() for p in trainer.parts.actor.model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in trainer.parts.actor.model.parameters())
    assert 0 < trainable < 0.2 * total
    exported = export_checkpoint(out / "lora_export" / "global_step_2", tmp_path / "hf")
    plain = AutoModelForCausalLM.from_pretrained(exported)
    assert not any("lora" in k for k in plain.state_dict())
    ids = torch.tensor([[1, 5, 9, 13, 2, 7]])
    with torch.no_grad():
        adapted = trainer.parts.actor.model.lm(input_ids=ids).logits
        base = AutoModelForCausalLM.from_pretrained(out / "sft")(input_ids=ids).logits
        merged = plain(input_ids=ids).logits
    assert (adapted - base).abs().max() > 1e-3  # the adapter did learn something
    assert torch.allclose(merged, adapted, atol=1e-4)


def test_length_metrics_of_an_episode_batch_count_every_response_token():
    """response_length/* counts every token after the prompt (policy and appended); a multi-turn batch adds the
    policy's own share; the critic/* statistics stay on the policy's tokens."""
    from posttrain.data.batch import Batch
    from posttrain.trainer.metrics import data_metrics

    policy = torch.tensor([[1, 1, 0, 0, 1, 0], [1, 0, 0, 0, 0, 0]])
    real = torch.tensor([[1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1]])
    advantages = torch.tensor([[1.0, 2.0, 50.0, 50.0, 3.0, 0.0], [4.0, 50.0, 50.0, 50.0, 50.0, 50.0]])
    tensors = {"response_mask": policy, "response_attention_mask": real, "advantages": advantages,
               "returns": advantages, "token_level_scores": torch.zeros(2, 6), "token_level_rewards": torch.zeros(2, 6),
               "prompt_mask": torch.ones(2, 3)}
    out = data_metrics(Batch(tensors, {"uid": ["a", "a"]}), max_response_length=6)
    assert (out["response_length/mean"], out["response_length/max"], out["response_length/min"]) == (5.5, 6.0, 5.0)
    assert out["response_length/clip_ratio"] == 0.5 and out["response_length/policy_tokens_mean"] == 2.0
    assert (out["critic/advantages/max"], out["critic/advantages/min"]) == (4.0, 1.0)
    single = {k: v for k, v in tensors.items() if k != "response_attention_mask"}
    out = data_metrics(Batch(single, {"uid": ["a", "a"]}), max_response_length=6)
    assert out["response_length/mean"] == 2.0 and "response_length/policy_tokens_mean" not in out
