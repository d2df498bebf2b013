#!/usr/bin/env bash
# GRPO on GSM8K with Qwen2.5-0.5B-Instruct on one GPU: full fine-tuning, KL to the reference as a loss.
# Data: bash examples/data_preprocess/gsm8k.sh. Keys given as arguments are appended and win, e.g.
#   bash examples/grpo_trainer/run_qwen2_5_0_5b_gsm8k.sh trainer.total_epochs=3 trainer.logger="['console','wandb']"
set -euo pipefail

MODEL_PATH=${MODEL_PATH:-Qwen/Qwen2.5-0.5B-Instruct}
DATA_DIR=${DATA_DIR:-data}
NGPUS=${NGPUS:-1}
NNODES=${NNODES:-1}

posttrain train \
    algorithm.adv_estimator=grpo \
    algorithm.norm_adv_by_std_in_grpo=True \
    algorithm.use_kl_in_reward=False \
    data.train_files="$DATA_DIR/gsm8k/train.parquet" \
    data.val_files="$DATA_DIR/gsm8k/test.parquet" \
    data.train_batch_size=256 \
    data.max_prompt_length=512 \
    data.max_response_length=1024 \
    data.filter_overlong_prompts=True \
    data.truncation=error \
    actor_rollout_ref.model.path="$MODEL_PATH" \
    actor_rollout_ref.model.enable_gradient_checkpointing=True \
    actor_rollout_ref.actor.optim.lr=1e-6 \
    actor_rollout_ref.actor.ppo_mini_batch_size=64 \
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16 \
    actor_rollout_ref.actor.use_kl_loss=True \
    actor_rollout_ref.actor.kl_loss_coef=0.001 \
    actor_rollout_ref.actor.kl_loss_type=low_var_kl \
    actor_rollout_ref.actor.loss_agg_mode=token-mean \
    actor_rollout_ref.actor.entropy_coeff=0 \
    actor_rollout_ref.rollout.n=5 \
    actor_rollout_ref.rollout.temperature=1.0 \
    actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=32 \
    actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=32 \
    trainer.logger="['console','tensorboard']" \
    trainer.project_name=grpo_gsm8k \
    trainer.experiment_name=qwen2_5_0_5b \
    trainer.nnodes="$NNODES" \
    trainer.n_gpus_per_node="$NGPUS" \
    trainer.test_freq=10 \
    trainer.save_freq=50 \
    trainer.total_epochs=15 \
    "$@"
