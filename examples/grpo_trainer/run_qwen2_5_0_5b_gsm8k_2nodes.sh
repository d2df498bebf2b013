#!/usr/bin/env bash
# GRPO on GSM8K with Qwen2.5-0.5B-Instruct on 2 nodes x 8 GPUs (FSDP2 over all 16): the model needs no second node
# (1 GB of state per GPU at 8), but twice the GPUs generate twice the answers per hour — here 2048 prompts x 8
# answers a step. Run this script once on every node, with the same MASTER_ADDR (any one node, usually the first)
# and RUN_ID; torchrun's c10d rendezvous forms one job of the 2 x 8 processes. Under Slurm, one task per node:
#   srun --nodes=2 --ntasks-per-node=1 env MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1) \
#       RUN_ID=$SLURM_JOB_ID bash examples/grpo_trainer/run_qwen2_5_0_5b_gsm8k_2nodes.sh
# The run folder (CKPT_DIR) and DATA_DIR must be on a file system every node sees. Keys given as arguments are
# appended and win.
set -euo pipefail

MODEL_PATH=${MODEL_PATH:-Qwen/Qwen2.5-0.5B-Instruct}
DATA_DIR=${DATA_DIR:-data}
NGPUS=${NGPUS:-8}
NNODES=${NNODES:-2}
MASTER_ADDR=${MASTER_ADDR:?set MASTER_ADDR to the address of the first node (the same on every node)}
MASTER_PORT=${MASTER_PORT:-29500}
RUN_ID=${RUN_ID:-grpo_qwen2_5_0_5b_gsm8k}
CKPT_DIR=${CKPT_DIR:-checkpoints/grpo_gsm8k/qwen2_5_0_5b_${NNODES}nodes}

torchrun --nnodes "$NNODES" --nproc_per_node "$NGPUS" \
    --rdzv_backend c10d --rdzv_endpoint "$MASTER_ADDR:$MASTER_PORT" --rdzv_id "$RUN_ID" \
    -m posttrain.cli train \
    algorithm.adv_estimator=grpo \
    algorithm.use_kl_in_reward=False \
    data.train_files="$DATA_DIR/gsm8k/train.parquet" \
    data.val_files="$DATA_DIR/gsm8k/test.parquet" \
    data.train_batch_size=2048 \
    data.max_prompt_length=512 \
    data.max_response_length=1024 \
    data.filter_overlong_prompts=True \
    data.truncation=error \
    actor_rollout_ref.model.path="$MODEL_PATH" \
    actor_rollout_ref.model.enable_gradient_checkpointing=True \
    actor_rollout_ref.actor.optim.lr=1e-6 \
    actor_rollout_ref.actor.ppo_mini_batch_size=512 \
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=32 \
    actor_rollout_ref.actor.use_kl_loss=True \
    actor_rollout_ref.actor.kl_loss_coef=0.001 \
    actor_rollout_ref.actor.kl_loss_type=low_var_kl \
    actor_rollout_ref.actor.loss_agg_mode=token-mean \
    actor_rollout_ref.actor.entropy_coeff=0 \
    actor_rollout_ref.rollout.n=8 \
    actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=64 \
    actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=64 \
    trainer.balance_batch=True \
    trainer.logger="['console','tensorboard']" \
    trainer.project_name=grpo_gsm8k \
    trainer.experiment_name=qwen2_5_0_5b_${NNODES}nodes \
    trainer.default_local_dir="$CKPT_DIR" \
    trainer.nnodes="$NNODES" \
    trainer.n_gpus_per_node="$NGPUS" \
    trainer.test_freq=5 \
    trainer.save_freq=20 \
    trainer.total_epochs=15 \
    "$@"
