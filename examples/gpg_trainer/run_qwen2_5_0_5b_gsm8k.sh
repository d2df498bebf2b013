#!/usr/bin/env bash
# GPG on GSM8K with Qwen2.5-0.5B-Instruct on one GPU: plain policy gradient on group-centred scores, rescaled by
# alpha = B / (B - M); no critic, no reference model, no KL, no ratio or clip (gpg.md).
# Data: bash examples/data_preprocess/gsm8k.sh. Keys given as arguments are appended and win.
set -euo pipefail

MODEL_PATH=${MODEL_PATH:-Qwen/Qwen2.5-0.5B-Instruct}
DATA_DIR=${DATA_DIR:-data}
NGPUS=${NGPUS:-1}
NNODES=${NNODES:-1}

posttrain train \
    algorithm.adv_estimator=gpg \
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
    actor_rollout_ref.actor.ppo_mini_batch_size=256 \
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16 \
    actor_rollout_ref.actor.policy_loss.loss_mode=gpg \
    actor_rollout_ref.actor.use_kl_loss=False \
    actor_rollout_ref.actor.loss_agg_mode=token-mean \
    actor_rollout_ref.actor.entropy_coeff=0 \
    actor_rollout_ref.rollout.n=5 \
    actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=32 \
    trainer.logger="['console','tensorboard']" \
    trainer.project_name=gpg_gsm8k \
    trainer.experiment_name=qwen2_5_0_5b \
    trainer.nnodes="$NNODES" \
    trainer.n_gpus_per_node="$NGPUS" \
    trainer.test_freq=10 \
    trainer.save_freq=50 \
    trainer.total_epochs=15 \
    "$@"
