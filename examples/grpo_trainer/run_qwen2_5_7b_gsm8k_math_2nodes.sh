#!/usr/bin/env bash
# GRPO on GSM8K + MATH with Qwen2.5-7B-Instruct on 2 nodes x 8 GPUs (FSDP2 over all 16). Run this script once on
# every node, with the same MASTER_ADDR (any one node, usually the first) and RUN_ID; torchrun's c10d rendezvous
# forms one job of the 2 x 8 processes. Under Slurm, one task per node:
#   srun --nodes=2 --ntasks-per-node=1 env MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1) \
#       RUN_ID=$SLURM_JOB_ID bash examples/grpo_trainer/run_qwen2_5_7b_gsm8k_math_2nodes.sh
# The run folder must be on a file system every node sees (CKPT_DIR). Data as in run_qwen2_5_7b_gsm8k_math_8gpu.sh,
# prepared where every node reads it. Keys given as arguments are appended and win.
set -euo pipefail

MODEL_PATH=${MODEL_PATH:-Qwen/Qwen2.5-7B-Instruct}
DATA_DIR=${DATA_DIR:-data}
NGPUS=${NGPUS:-8}
NNODES=${NNODES:-2}
MASTER_ADDR=${MASTER_ADDR:?set MASTER_ADDR to the address of the first node (the same on every node)}
MASTER_PORT=${MASTER_PORT:-29500}
RUN_ID=${RUN_ID:-grpo_qwen2_5_7b_gsm8k_math}
CKPT_DIR=${CKPT_DIR:-checkpoints/grpo_gsm8k_math/qwen2_5_7b_${NNODES}nodes}

TRAIN_FILES="'$DATA_DIR/gsm8k/train.parquet'"
if [ -f "$DATA_DIR/math/train.parquet" ]; then TRAIN_FILES+=",'$DATA_DIR/math/train.parquet'"; fi

torchrun --nnodes "$NNODES" --nproc_per_node "$NGPUS" \
    --rdzv_backend c10d --rdzv_endpoint "$MASTER_ADDR:$MASTER_PORT" --rdzv_id "$RUN_ID" \
    -m posttrain.cli train \
    algorithm.adv_estimator=grpo \
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
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8 \
    actor_rollout_ref.actor.use_kl_loss=True \
    actor_rollout_ref.actor.kl_loss_coef=0.001 \
    actor_rollout_ref.actor.kl_loss_type=low_var_kl \
    actor_rollout_ref.actor.loss_agg_mode=token-mean \
    actor_rollout_ref.actor.entropy_coeff=0 \
    actor_rollout_ref.rollout.n=5 \
    actor_rollout_ref.rollout.micro_batch_size=12 \
    actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=16 \
    actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=16 \
    actor_rollout_ref.ref.fsdp_config.param_offload=True \
    trainer.balance_batch=True \
    trainer.logger="['console','tensorboard']" \
    trainer.project_name=grpo_gsm8k_math \
    trainer.experiment_name=qwen2_5_7b_${NNODES}nodes \
    trainer.default_local_dir="$CKPT_DIR" \
    trainer.nnodes="$NNODES" \
    trainer.n_gpus_per_node="$NGPUS" \
    trainer.test_freq=5 \
    trainer.save_freq=20 \
    trainer.total_epochs=15 \
    "$@"
