#!/usr/bin/env bash
# GRPO on GSM8K with a tool: Qwen2.5-3B-Instruct on one GPU checks its answer with calc_gsm8k_reward (verl's GSM8K
# tool, config/gsm8k_tool_config.yaml) before answering; episodes of up to 5 assistant turns, the loss on the
# policy's own tokens only. Data: posttrain prepare gsm8k --tools --output-dir "$DATA_DIR/gsm8k_tools".
# Keys given as arguments are appended and win.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)

MODEL_PATH=${MODEL_PATH:-Qwen/Qwen2.5-3B-Instruct}
DATA_DIR=${DATA_DIR:-data}
NGPUS=${NGPUS:-1}
NNODES=${NNODES:-1}

posttrain train \
    algorithm.adv_estimator=grpo \
    algorithm.use_kl_in_reward=False \
    data.train_files="$DATA_DIR/gsm8k_tools/train.parquet" \
    data.val_files="$DATA_DIR/gsm8k_tools/test.parquet" \
    data.train_batch_size=64 \
    data.max_prompt_length=1024 \
    data.max_response_length=1024 \
    data.filter_overlong_prompts=True \
    data.truncation=error \
    data.return_raw_chat=True \
    actor_rollout_ref.model.path="$MODEL_PATH" \
    actor_rollout_ref.model.enable_gradient_checkpointing=True \
    actor_rollout_ref.actor.optim.lr=1e-6 \
    actor_rollout_ref.actor.ppo_mini_batch_size=32 \
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4 \
    actor_rollout_ref.actor.use_kl_loss=True \
    actor_rollout_ref.actor.kl_loss_coef=0.001 \
    actor_rollout_ref.actor.kl_loss_type=low_var_kl \
    actor_rollout_ref.actor.entropy_coeff=0 \
    actor_rollout_ref.rollout.n=8 \
    actor_rollout_ref.rollout.mode=async \
    actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8 \
    actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=8 \
    actor_rollout_ref.rollout.multi_turn.enable=True \
    actor_rollout_ref.rollout.multi_turn.max_assistant_turns=5 \
    actor_rollout_ref.rollout.multi_turn.tool_config_path="$HERE/config/gsm8k_tool_config.yaml" \
    actor_rollout_ref.rollout.agent.default_agent_loop=tool_agent \
    trainer.logger="['console','tensorboard']" \
    trainer.project_name=multiturn_gsm8k \
    trainer.experiment_name=qwen2_5_3b_tool_agent \
    trainer.nnodes="$NNODES" \
    trainer.n_gpus_per_node="$NGPUS" \
    trainer.test_freq=10 \
    trainer.save_freq=50 \
    trainer.total_epochs=5 \
    "$@"
