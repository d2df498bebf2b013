#!/usr/bin/env bash
# GRPO on GSM8K with Qwen2.5-7B-Instruct on one GPU: a LoRA adapter (rank 64 on every linear layer, 2% of the
# weights) trains on a frozen bf16 base, and the reference policy is the same model with the adapter off (no second
# copy). Full fine-tuning of 7B needs 122 GB of weights, gradients and Adam state; this needs 18 GB, kept in host
# memory between uses by param_offload (docs/scaling.md, "7B, LoRA r=64, bf16 base, param_offload").
# LoRA learns at a larger rate than full fine-tuning (3e-5 here against 1e-6).
# Data: bash examples/data_preprocess/gsm8k.sh. Keys given as arguments are appended and win.
set -euo pipefail

MODEL_PATH=${MODEL_PATH:-Qwen/Qwen2.5-7B-Instruct}
DATA_DIR=${DATA_DIR:-data}
NGPUS=${NGPUS:-1}
NNODES=${NNODES:-1}

posttrain train \
    algorithm.adv_estimator=grpo \
    algorithm.use_kl_in_reward=False \
    data.train_files="$DATA_DIR/gsm8k/train.parquet" \
    data.val_files="$DATA_DIR/gsm8k/test.parquet" \
    data.train_batch_size=128 \
    data.max_prompt_length=512 \
    data.max_response_length=1024 \
    data.filter_overlong_prompts=True \
    data.truncation=error \
    actor_rollout_ref.model.path="$MODEL_PATH" \
    actor_rollout_ref.model.lora_rank=64 \
    actor_rollout_ref.model.lora_alpha=32 \
    actor_rollout_ref.model.target_modules=all-linear \
    actor_rollout_ref.model.enable_gradient_checkpointing=True \
    actor_rollout_ref.actor.optim.lr=3e-5 \
    actor_rollout_ref.actor.ppo_mini_batch_size=32 \
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8 \
    actor_rollout_ref.actor.use_kl_loss=True \
    actor_rollout_ref.actor.kl_loss_coef=0.001 \
    actor_rollout_ref.actor.kl_loss_type=low_var_kl \
    actor_rollout_ref.actor.loss_agg_mode=token-mean \
    actor_rollout_ref.actor.entropy_coeff=0 \
    actor_rollout_ref.actor.fsdp_config.model_dtype=bf16 \
    actor_rollout_ref.actor.fsdp_config.param_offload=True \
    actor_rollout_ref.rollout.n=5 \
    actor_rollout_ref.rollout.micro_batch_size=16 \
    actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=16 \
    actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=16 \
    trainer.logger="['console','tensorboard']" \
    trainer.project_name=grpo_gsm8k \
    trainer.experiment_name=qwen2_5_7b_lora64 \
    trainer.nnodes="$NNODES" \
    trainer.n_gpus_per_node="$NGPUS" \
    trainer.test_freq=5 \
    trainer.save_freq=20 \
    trainer.total_epochs=5 \
    "$@"
