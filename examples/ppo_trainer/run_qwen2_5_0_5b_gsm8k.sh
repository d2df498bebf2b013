#!/usr/bin/env bash
# PPO on GSM8K with Qwen2.5-0.5B-Instruct on one GPU: an actor and a critic (a value head on a second copy of the
# model), GAE advantages, the clipped policy and value losses, and KL to the reference subtracted from the reward
# with an adaptive coefficient (it grows when the measured KL is above target_kl, shrinks when below).
# Data: bash examples/data_preprocess/gsm8k.sh. Keys given as arguments are appended and win.
set -euo pipefail

MODEL_PATH=${MODEL_PATH:-Qwen/Qwen2.5-0.5B-Instruct}
DATA_DIR=${DATA_DIR:-data}
NGPUS=${NGPUS:-1}
NNODES=${NNODES:-1}

posttrain train \
    algorithm.adv_estimator=gae \
    algorithm.gamma=1.0 \
    algorithm.lam=0.95 \
    algorithm.use_kl_in_reward=True \
    algorithm.kl_penalty=kl \
    algorithm.kl_ctrl.type=adaptive \
    algorithm.kl_ctrl.kl_coef=0.001 \
    algorithm.kl_ctrl.target_kl=0.05 \
    algorithm.kl_ctrl.horizon=10000 \
    data.train_files="$DATA_DIR/gsm8k/train.parquet" \
    data.val_files="$DATA_DIR/gsm8k/test.parquet" \
    data.train_batch_size=256 \
    data.max_prompt_length=512 \
    data.max_response_length=512 \
    data.filter_overlong_prompts=True \
    data.truncation=error \
    actor_rollout_ref.model.path="$MODEL_PATH" \
    actor_rollout_ref.model.enable_gradient_checkpointing=True \
    actor_rollout_ref.actor.optim.lr=1e-6 \
    actor_rollout_ref.actor.ppo_mini_batch_size=64 \
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16 \
    actor_rollout_ref.actor.ppo_epochs=1 \
    actor_rollout_ref.actor.clip_ratio=0.2 \
    actor_rollout_ref.actor.use_kl_loss=False \
    actor_rollout_ref.actor.loss_agg_mode=token-mean \
    actor_rollout_ref.actor.entropy_coeff=0 \
    actor_rollout_ref.rollout.n=1 \
    actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=32 \
    actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=32 \
    critic.model.path="$MODEL_PATH" \
    critic.model.enable_gradient_checkpointing=True \
    critic.optim.lr=1e-5 \
    critic.ppo_micro_batch_size_per_gpu=16 \
    critic.cliprange_value=0.5 \
    trainer.critic_warmup=0 \
    trainer.logger="['console','tensorboard']" \
    trainer.project_name=ppo_gsm8k \
    trainer.experiment_name=qwen2_5_0_5b \
    trainer.nnodes="$NNODES" \
    trainer.n_gpus_per_node="$NGPUS" \
    trainer.test_freq=10 \
    trainer.save_freq=50 \
    trainer.total_epochs=15 \
    "$@"
