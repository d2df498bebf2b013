#!/usr/bin/env bash
# GPG on GSM8K + MATH with Qwen2.5-7B-Instruct on the 8 GPUs of one node (FSDP2 over 8). With no reference model and
# no critic, the actor is the only model in memory. One mini-batch per step (ppo_mini_batch_size = train_batch_size):
# GPG has no ratio, so every step is on-policy and needs no old-log-prob pass.
# Data: bash examples/data_preprocess/gsm8k.sh && bash examples/data_preprocess/math.sh (MATH-500 is a test set:
# training reads GSM8K alone unless $DATA_DIR/math/train.parquet exists). Keys given as arguments are appended and win.
set -euo pipefail

MODEL_PATH=${MODEL_PATH:-Qwen/Qwen2.5-7B-Instruct}
DATA_DIR=${DATA_DIR:-data}
NGPUS=${NGPUS:-8}
NNODES=${NNODES:-1}

TRAIN_FILES="'$DATA_DIR/gsm8k/train.parquet'"
if [ -f "$DATA_DIR/math/train.parquet" ]; then TRAIN_FILES+=",'$DATA_DIR/math/train.parquet'"; fi

posttrain train \
    algorithm.adv_estimator=gpg \
    algorithm.use_kl_in_reward=False \
    data.train_files="[$TRAIN_FILES]" \
    data.val_files="['$DATA_DIR/gsm8k/test.parquet','$DATA_DIR/math/test.parquet']" \
    data.train_batch_size=512 \
    data.max_prompt_length=1024 \
    data.max_response_length=2048 \
    data.filter_overlong_prompts=True \
    data.truncation=error \
    actor_rollout_ref.model.path="$MODEL_PATH" \
    actor_rollout_ref.model.enable_gradient_checkpointing=True \
    actor_rollout_ref.actor.optim.lr=1e-6 \
    actor_rollout_ref.actor.ppo_mini_batch_size=512 \
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8 \
    actor_rollout_ref.actor.policy_loss.loss_mode=gpg \
    actor_rollout_ref.actor.use_kl_loss=False \
    actor_rollout_ref.actor.loss_agg_mode=token-mean \
    actor_rollout_ref.actor.entropy_coeff=0 \
    actor_rollout_ref.rollout.n=5 \
    actor_rollout_ref.rollout.micro_batch_size=12 \
    actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=16 \
    trainer.balance_batch=True \
    trainer.logger="['console','tensorboard']" \
    trainer.project_name=gpg_gsm8k_math \
    trainer.experiment_name=qwen2_5_7b_8gpu \
    trainer.nnodes="$NNODES" \
    trainer.n_gpus_per_node="$NGPUS" \
    trainer.test_freq=5 \
    trainer.save_freq=20 \
    trainer.total_epochs=15 \
    "$@"
