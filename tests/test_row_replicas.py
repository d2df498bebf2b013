"""Megatron layouts keep Megatron's data-parallel size: pipeline ranks become row replicas (ranks computing the same
rows whole and sharding the model between them, `actor.row_replicas`), context ranks Ulysses sequence parallel (or
row replicas beside tensor parallel); one process equals the layout."""

import json

import pytest
import torch

from posttrain.config import ConfigError, config_warnings, hydra_config, load_config
from tests.test_distributed import METRICS, fixed_batch, run_worker  # noqa: F401  (fixed_batch: a fixture)
from tests.same_update import assert_same_training

OK = ["data.train_batch_size=8", "actor_rollout_ref.actor.ppo_mini_batch_size=4"]
REPLICAS = {  # each case's layout at 2 processes; the one-process run drops these keys
    "grpo_megatron_pipeline": ["actor_rollout_ref.actor.strategy=megatron",
                               "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=2"],
    "ppo_row_replicas": ["actor_rollout_ref.actor.row_replicas=2"],
}
CASES = {
    "grpo_megatron_pipeline": ["algorithm.adv_estimator=grpo", "actor_rollout_ref.actor.use_kl_loss=True",
                               "actor_rollout_ref.rollout.n=4",
                               "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2"],
    "ppo_row_replicas": ["algorithm.adv_estimator=gae", "critic.optim.lr=1e-3", "actor_rollout_ref.rollout.n=2"],
}


def run_step(fixed_batch, model, name: str, nproc: int):
    out = fixed_batch / name
    out.mkdir(exist_ok=True)
    base = [f"actor_rollout_ref.model.path={model}", f"data.train_files={fixed_batch / 'train.jsonl'}",
            "data.train_batch_size=2", "data.shuffle=False", "data.max_prompt_length=64",
            "data.max_response_length=6", "actor_rollout_ref.rollout.do_sample=False",
            "actor_rollout_ref.actor.ppo_mini_batch_size=2", "actor_rollout_ref.actor.optim.lr=1e-4",
            "actor_rollout_ref.model.dtype=fp32", "actor_rollout_ref.rollout.dtype=fp32",
            "actor_rollout_ref.model.enable_gradient_checkpointing=False", "reward_model.num_workers=0",
            "trainer.logger=['jsonl']", f"trainer.default_local_dir={out / 'run'}", f"trainer.n_gpus_per_node={nproc}"]
    cases = {case: extra + (REPLICAS[case] if nproc > 1 else []) for case, extra in CASES.items()}
    return run_worker({"base": base, "cases": cases, "out": str(out), "steps": "single"}, out, nproc)


def test_two_row_replicas_equal_one_process(fixed_batch, tiny_model_dir):
    """2 processes that hold the same rows (one data-parallel rank; Megatron's pipeline size 2, or row_replicas=2
    with PPO's critic) run a whole greedy step — each generates the step's rows, both keep the first's — and give
    one process's batch, metrics, gradients and weights; each holds half of every sharded weight."""
    one = run_step(fixed_batch, tiny_model_dir, "replicas_one", 1)
    two = run_step(fixed_batch, tiny_model_dir, "replicas_two", 2)
    for case in CASES:
        generated = [json.loads((two / f"{case}_generated_rank{r}.json").read_text()) for r in range(2)]
        assert generated[0] == generated[1] and generated[0], case  # both ranks generated every prompt
        want, got = (torch.load(d / f"{case}.pt", weights_only=False) for d in (one, two))
        assert got["uid"] == want["uid"]
        for key in ("input_ids", "attention_mask", "response_mask", "token_level_scores"):
            assert torch.equal(got["tensors"][key], want["tensors"][key]), (case, key)
        for key in METRICS:
            if key in want["metrics"]:
                assert got["metrics"][key] == pytest.approx(want["metrics"][key], rel=1e-5, abs=1e-6), (case, key)
        assert_same_training(want, got, case)


def test_megatron_layouts_keep_their_data_parallel_size(tiny_model_dir, tmp_path):
    """The newest tree's Megatron lines: tensor x pipeline x context parallel divide the processes as in Megatron,
    and the batches split over the data-parallel ranks that leave (1, 2, 32 and 2 here; they were refused as 12, 6,
    64 and 32 FSDP2 ranks before)."""
    from tests.test_porting import NEWEST, _script_argv

    data = tmp_path / "rows.jsonl"
    data.write_text("")
    for name, (tp, replicas, sp, dp) in {
            "grpo_trainer__run_deepseek_v3_671b_megatron.json": (8, 12, 1, 1),
            "grpo_trainer__run_moonlight_16b_a3b_megatron.json": (4, 3, 1, 2),
            "grpo_trainer__run_qwen3_5_397b_megatron.json": (2, 2, 1, 32),
            "ascend_extras__grpo_trainer__run_qwen3_5_122b_a10b_32k_megatron.json": (2, 16, 1, 2)}.items():
        _, hydra, overrides = _script_argv(name, str(tiny_model_dir), str(tiny_model_dir / "config.json"),
                                           folder=NEWEST)
        overrides = [o for o in overrides if not o.startswith(("data.train_files", "data.val_files"))] + [
            "actor_rollout_ref.rollout.name=posttrain"]  # (vLLM is not installed here; its keys stay)
        config_file, base = hydra_config(hydra.get("--config-path"), hydra.get("--config-name", "").strip("'"))
        cfg = load_config(config_file, base + overrides)
        actor = cfg.actor_rollout_ref.actor
        assert (actor.fsdp_config.tp_size, actor.row_replicas, actor.ulysses_sequence_parallel_size) == (tp, replicas,
                                                                                                         sp), name
        notes = "\n".join(config_warnings(cfg))
        assert f"x {dp} data-parallel ranks, Megatron's data-parallel size" in notes, (name, notes)
        if "ascend" in name:  # context parallel 4 beside tensor parallel 2: its ranks hold the same rows
            assert "context_parallel_size=4 with tensor parallel 2 -> actor_rollout_ref.actor.row_replicas=16" in notes
    cp = load_config(None, OK + ["actor_rollout_ref.actor.strategy=megatron", "trainer.n_gpus_per_node=4",
                                 "actor_rollout_ref.actor.megatron.context_parallel_size=2",
                                 "actor_rollout_ref.model.use_remove_padding=True"])
    assert cp.actor_rollout_ref.actor.ulysses_sequence_parallel_size == 2  # context parallel = Ulysses
    with pytest.raises(ConfigError, match="row_replicas=3 must divide the 4 processes"):
        load_config(None, OK + ["trainer.n_gpus_per_node=4", "actor_rollout_ref.actor.row_replicas=3"])
    with pytest.raises(ConfigError, match="row_replicas=2 with fsdp_config.fsdp_size=1: not supported"):
        load_config(None, OK + ["trainer.n_gpus_per_node=4", "actor_rollout_ref.actor.row_replicas=2",
                                "actor_rollout_ref.actor.fsdp_config.fsdp_size=1"])
