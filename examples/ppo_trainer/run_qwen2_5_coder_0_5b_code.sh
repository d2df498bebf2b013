#!/usr/bin/env bash
# PPO on code problems with Qwen2.5-Coder-0.5B-Instruct on one GPU, rewarded by running the answer's program against
# the problem's tests in a bubblewrap sandbox (no network, read-only root, limits on time, memory, processes and
# output): 1 when every test passes, else 0; reward/pass_rate/mean logs the fraction passed. Four scorer processes
# per training process run the programs; each stdin test is a program run of at most run_timeout seconds, so
# reward_model.timeout_s (per answer) must cover run_timeout times the tests of a problem.
# Data: bash examples/data_preprocess/code.sh (the 33 bundled problems; any rows in the code layouts of
# the README work). Keys given as arguments are appended and win.
set -euo pipefail

MODEL_PATH=${MODEL_PATH:-Qwen/Qwen2.5-Coder-0.5B-Instruct}
DATA_DIR=${DATA_DIR:-data}
NGPUS=${NGPUS:-1}
NNODES=${NNODES:-1}

posttrain train \
    algorithm.adv_estimator=gae \
    algorithm.use_kl_in_reward=False \
    data.train_files="$DATA_DIR/code/train.parquet" \
    data.val_files="$DATA_DIR/code/test.parquet" \
    data.train_batch_size=16 \
    data.max_prompt_length=1024 \
    data.max_response_length=1024 \
    data.filter_overlong_prompts=True \
    data.truncation=error \
    actor_rollout_ref.model.path="$MODEL_PATH" \
    actor_rollout_ref.model.enable_gradient_checkpointing=True \
    actor_rollout_ref.actor.optim.lr=1e-6 \
    actor_rollout_ref.actor.ppo_mini_batch_size=8 \
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8 \
    actor_rollout_ref.actor.use_kl_loss=False \
    actor_rollout_ref.rollout.n=1 \
    actor_rollout_ref.rollout.temperature=1.0 \
    actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=16 \
    critic.model.path="$MODEL_PATH" \
    critic.optim.lr=1e-5 \
    critic.ppo_micro_batch_size_per_gpu=8 \
    reward_model.num_workers=4 \
    reward_model.timeout_s=60 \
    reward_model.code_sandbox.run_timeout=5 \
    reward_model.sandbox_fusion.memory_limit_mb=1024 \
    trainer.logger="['console','tensorboard']" \
    trainer.project_name=ppo_code \
    trainer.experiment_name=qwen2_5_coder_0_5b \
    trainer.nnodes="$NNODES" \
    trainer.n_gpus_per_node="$NGPUS" \
    trainer.test_freq=5 \
    trainer.save_freq=20 \
    trainer.total_epochs=30 \
    "$@"
