#!/usr/bin/env bash
# Tiny CPU twin of run_qwen2_5_7b_gsm8k_math_dynamic_bsz_8gpu.sh: that script with its own keys, on the offline tiny
# model and data, 2 steps, 2 CPU processes (gloo) started by `posttrain train` itself in place of the 8 GPU workers.
# The token budgets shrink with the tiny sequences (at most 256 + 16 tokens) so that a step really splits into
# several token-budget micro-batches.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
source "$HERE/../tiny_cpu/common.sh"
NGPUS=2 NNODES=1 bash "$HERE/run_qwen2_5_7b_gsm8k_math_dynamic_bsz_8gpu.sh" "${TINY_ARGS[@]}" \
    actor_rollout_ref.actor.ppo_max_token_len_per_gpu=64 \
    actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=128 \
    critic.ppo_max_token_len_per_gpu=128 "$@"
