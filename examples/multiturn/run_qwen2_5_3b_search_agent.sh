#!/usr/bin/env bash
# GRPO for a search agent: Qwen2.5-3B-Instruct on one GPU answers questions about a small invented archipelago by
# calling `search` (verl's search tool, config/search_tool_config.yaml) over a local corpus (config/local_corpus.jsonl,
# ranked with BM25: pip install 'posttrain[agents]'), and is scored by exact match of its <answer> (search_reward.py).
# The questions ship in data/search_qa; point DATA_DIR at a folder with search_qa/{train,test}.jsonl, and corpus_path
# at your corpus, for your own. Keys given as arguments are appended and win.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)

MODEL_PATH=${MODEL_PATH:-Qwen/Qwen2.5-3B-Instruct}
DATA_DIR=${DATA_DIR:-$HERE/data}
NGPUS=${NGPUS:-1}
NNODES=${NNODES:-1}

posttrain train \
    algorithm.adv_estimator=grpo \
    algorithm.use_kl_in_reward=False \
    data.train_files="$DATA_DIR/search_qa/train.jsonl" \
    data.val_files="$DATA_DIR/search_qa/test.jsonl" \
    data.train_batch_size=8 \
    data.max_prompt_length=512 \
    data.max_response_length=1024 \
    data.filter_overlong_prompts=True \
    data.truncation=error \
    data.return_raw_chat=True \
    actor_rollout_ref.model.path="$MODEL_PATH" \
    actor_rollout_ref.model.enable_gradient_checkpointing=True \
    actor_rollout_ref.actor.optim.lr=1e-6 \
    actor_rollout_ref.actor.ppo_mini_batch_size=8 \
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4 \
    actor_rollout_ref.actor.use_kl_loss=True \
    actor_rollout_ref.actor.kl_loss_coef=0.001 \
    actor_rollout_ref.actor.kl_loss_type=low_var_kl \
    actor_rollout_ref.actor.entropy_coeff=0 \
    actor_rollout_ref.rollout.n=8 \
    actor_rollout_ref.rollout.mode=async \
    actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8 \
    actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=8 \
    actor_rollout_ref.rollout.multi_turn.enable=True \
    actor_rollout_ref.rollout.multi_turn.max_assistant_turns=3 \
    actor_rollout_ref.rollout.multi_turn.max_tool_response_length=1024 \
    actor_rollout_ref.rollout.multi_turn.tool_config_path="$HERE/config/search_tool_config.yaml" \
    actor_rollout_ref.rollout.agent.default_agent_loop=tool_agent \
    custom_reward_function.path="$HERE/search_reward.py" \
    trainer.logger="['console','tensorboard']" \
    trainer.project_name=multiturn_search \
    trainer.experiment_name=qwen2_5_3b_local_search \
    trainer.nnodes="$NNODES" \
    trainer.n_gpus_per_node="$NGPUS" \
    trainer.test_freq=5 \
    trainer.save_freq=-1 \
    trainer.total_epochs=20 \
    "$@"
