#!/usr/bin/env bash
# GRPO on MATH with a code interpreter: Qwen2.5-3B-Instruct on one GPU runs Python through code_interpreter (verl's
# SandboxFusion tool, config/code_interpreter_tool_config.yaml: posttrain's local sandbox, or a SandboxFusion server
# with sandbox_fusion_url) and answers in \boxed{}; up to 8 assistant turns, tool results cut to 512 characters.
# Data: posttrain prepare math --tools --input MATH_DIR --output-dir "$DATA_DIR/math_tools" (a folder with MATH's
# train.jsonl and test.jsonl). Keys given as arguments are appended and win.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)

MODEL_PATH=${MODEL_PATH:-Qwen/Qwen2.5-3B-Instruct}
DATA_DIR=${DATA_DIR:-data}
NGPUS=${NGPUS:-1}
NNODES=${NNODES:-1}

posttrain train \
    algorithm.adv_estimator=grpo \
    algorithm.use_kl_in_reward=False \
    data.train_files="$DATA_DIR/math_tools/train.parquet" \
    data.val_files="$DATA_DIR/math_tools/test.parquet" \
    data.train_batch_size=64 \
    data.max_prompt_length=1024 \
    data.max_response_length=2048 \
    data.filter_overlong_prompts=True \
    data.truncation=error \
    data.return_raw_chat=True \
    actor_rollout_ref.model.path="$MODEL_PATH" \
    actor_rollout_ref.model.enable_gradient_checkpointing=True \
    actor_rollout_ref.actor.optim.lr=1e-6 \
    actor_rollout_ref.actor.ppo_mini_batch_size=32 \
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2 \
    actor_rollout_ref.actor.use_kl_loss=False \
    actor_rollout_ref.actor.loss_agg_mode=token-mean \
    actor_rollout_ref.actor.entropy_coeff=0 \
    actor_rollout_ref.rollout.n=8 \
    actor_rollout_ref.rollout.mode=async \
    actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4 \
    actor_rollout_ref.rollout.multi_turn.enable=True \
    actor_rollout_ref.rollout.multi_turn.max_assistant_turns=8 \
    actor_rollout_ref.rollout.multi_turn.max_parallel_calls=1 \
    actor_rollout_ref.rollout.multi_turn.max_tool_response_length=512 \
    actor_rollout_ref.rollout.multi_turn.tool_response_truncate_side=middle \
    actor_rollout_ref.rollout.multi_turn.tool_config_path="$HERE/config/code_interpreter_tool_config.yaml" \
    actor_rollout_ref.rollout.agent.default_agent_loop=tool_agent \
    trainer.logger="['console','tensorboard']" \
    trainer.project_name=multiturn_math \
    trainer.experiment_name=qwen2_5_3b_code_interpreter \
    trainer.nnodes="$NNODES" \
    trainer.n_gpus_per_node="$NGPUS" \
    trainer.test_freq=10 \
    trainer.save_freq=50 \
    trainer.total_epochs=5 \
    "$@"
