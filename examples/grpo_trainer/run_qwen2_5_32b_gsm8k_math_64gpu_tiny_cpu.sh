#!/usr/bin/env bash
# Tiny CPU twin of run_qwen2_5_32b_gsm8k_math_64gpu.sh: that script with its own keys and its torchrun launch, on
# the offline tiny model and data, 2 steps, as one "node" of 2 CPU processes (gloo) that form one tensor-parallel
# group of 2 (TP_SIZE=2: the tiny model's 4 attention heads split in two) in place of 8 nodes x 8 GPUs with TP 8.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
source "$HERE/../tiny_cpu/common.sh"
NGPUS=2 NNODES=1 TP_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=$(free_port) RUN_ID=tiny_cpu_$$ \
    bash "$HERE/run_qwen2_5_32b_gsm8k_math_64gpu.sh" "${TINY_ARGS[@]}" "$@"
