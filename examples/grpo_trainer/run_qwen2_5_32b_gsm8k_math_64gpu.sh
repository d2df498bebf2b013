#!/usr/bin/env bash
# GRPO on GSM8K + MATH with Qwen2.5-32B-Instruct on 8 nodes x 8 GPUs, laid out as docs/scaling.md recommends:
# tensor parallel 8 inside each node (the per-layer all-reduces stay on NVLink) x FSDP2 8 across the nodes.
# Predicted per GPU: 10.9 GB of state, a 10.9 GB gathered model and 4.3 GB of KV cache while generating, 34-40 GB in
# the update with 16384-token micro-batches. With FSDP alone, generation would gather all 65.6 GB of the bf16 model
# on every GPU. Rank 0 reads the whole model into host memory first (131 GB in fp32).
# Run this script once on every node with the same MASTER_ADDR and RUN_ID, e.g. under Slurm (one task per node):
#   srun --nodes=8 --ntasks-per-node=1 env MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1) \
#       RUN_ID=$SLURM_JOB_ID bash examples/grpo_trainer/run_qwen2_5_32b_gsm8k_math_64gpu.sh
# CKPT_DIR and DATA_DIR must be on a file system every node sees. Keys given as arguments are appended and win.
set -euo pipefail

MODEL_PATH=${MODEL_PATH:-Qwen/Qwen2.5-32B-Instruct}
DATA_DIR=${DATA_DIR:-data}
NGPUS=${NGPUS:-8}
NNODES=${NNODES:-8}
TP_SIZE=${TP_SIZE:-8}
MASTER_ADDR=${MASTER_ADDR:?set MASTER_ADDR to the address of the first node (the same on every node)}
MASTER_PORT=${MASTER_PORT:-29500}
RUN_ID=${RUN_ID:-grpo_qwen2_5_32b_gsm8k_math}
CKPT_DIR=${CKPT_DIR:-checkpoints/grpo_gsm8k_math/qwen2_5_32b_tp${TP_SIZE}}

TRAIN_FILES="'$DATA_DIR/gsm8k/train.parquet'"
if [ -f "$DATA_DIR/math/train.parquet" ]; then TRAIN_FILES+=",'$DATA_DIR/math/train.parquet'"; fi

torchrun --nnodes "$NNODES" --nproc_per_node "$NGPUS" \
    --rdzv_backend c10d --rdzv_endpoint "$MASTER_ADDR:$MASTER_PORT" --rdzv_id "$RUN_ID" \
    -m posttrain.cli train \
    algorithm.adv_estimator=grpo \
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
    actor_rollout_ref.actor.fsdp_config.tp_size="$TP_SIZE" \
    actor_rollout_ref.actor.optim.lr=5e-7 \
    actor_rollout_ref.actor.ppo_mini_batch_size=128 \
    actor_rollout_ref.actor.use_dynamic_bsz=True \
    actor_rollout_ref.actor.ppo_max_token_len_per_gpu=16384 \
    actor_rollout_ref.actor.use_kl_loss=True \
    actor_rollout_ref.actor.kl_loss_coef=0.001 \
    actor_rollout_ref.actor.kl_loss_type=low_var_kl \
    actor_rollout_ref.actor.loss_agg_mode=token-mean \
    actor_rollout_ref.actor.entropy_coeff=0 \
    actor_rollout_ref.rollout.n=5 \
    actor_rollout_ref.rollout.micro_batch_size=12 \
    actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=True \
    actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=32768 \
    actor_rollout_ref.ref.log_prob_use_dynamic_bsz=True \
    actor_rollout_ref.ref.log_prob_max_token_len_per_gpu=32768 \
    actor_rollout_ref.ref.fsdp_config.model_dtype=bf16 \
    trainer.balance_batch=True \
    trainer.logger="['console','tensorboard']" \
    trainer.project_name=grpo_gsm8k_math \
    trainer.experiment_name=qwen2_5_32b_tp${TP_SIZE} \
    trainer.default_local_dir="$CKPT_DIR" \
    trainer.nnodes="$NNODES" \
    trainer.n_gpus_per_node="$NGPUS" \
    trainer.test_freq=5 \
    trainer.save_freq=10 \
    trainer.total_epochs=5 \
    "$@"
