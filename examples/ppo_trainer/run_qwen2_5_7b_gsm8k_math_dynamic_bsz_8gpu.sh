#!/usr/bin/env bash
# PPO on GSM8K + MATH with Qwen2.5-7B-Instruct on the 8 GPUs of one node, with token-budget micro-batches: instead
# of a fixed number of answers, each micro-batch packs whole answers up to a number of tokens per GPU
# (ppo_max_token_len_per_gpu: about 3 x (prompt + response) for the actor, twice that for the critic and the
# gradient-free log-prob passes), so short GSM8K answers and long MATH ones fill the GPU alike; balance_batch gives
# every GPU about the same number of tokens.
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
    algorithm.adv_estimator=gae \
    algorithm.use_kl_in_reward=False \
    data.train_files="[$TRAIN_FILES]" \
    data.val_files="['$DATA_DIR/gsm8k/test.parquet','$DATA_DIR/math/test.parquet']" \
    data.train_batch_size=1024 \
    data.max_prompt_length=1024 \
    data.max_response_length=2048 \
    data.filter_overlong_prompts=True \
    data.truncation=error \
    actor_rollout_ref.model.path="$MODEL_PATH" \
    actor_rollout_ref.model.enable_gradient_checkpointing=True \
    actor_rollout_ref.actor.optim.lr=1e-6 \
    actor_rollout_ref.actor.ppo_mini_batch_size=256 \
    actor_rollout_ref.actor.use_dynamic_bsz=True \
    actor_rollout_ref.actor.ppo_max_token_len_per_gpu=9216 \
    actor_rollout_ref.actor.use_kl_loss=False \
    actor_rollout_ref.rollout.n=1 \
    actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=True \
    actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=18432 \
    critic.model.path="$MODEL_PATH" \
    critic.model.enable_gradient_checkpointing=True \
    critic.optim.lr=1e-5 \
    critic.use_dynamic_bsz=True \
    critic.ppo_max_token_len_per_gpu=18432 \
    trainer.balance_batch=True \
    trainer.critic_warmup=0 \
    trainer.logger="['console','tensorboard']" \
    trainer.project_name=ppo_gsm8k_math \
    trainer.experiment_name=qwen2_5_7b_dynamic_bsz \
    trainer.nnodes="$NNODES" \
    trainer.n_gpus_per_node="$NGPUS" \
    trainer.test_freq=5 \
    trainer.save_freq=20 \
    trainer.total_epochs=15 \
    "$@"
