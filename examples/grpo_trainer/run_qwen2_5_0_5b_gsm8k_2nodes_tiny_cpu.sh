#!/usr/bin/env bash
# Tiny CPU twin of run_qwen2_5_0_5b_gsm8k_2nodes.sh: that script with its own keys and its torchrun launch, on the
# offline tiny model and data, 2 steps, as one "node" of one CPU process (two local nodes are run by the twin of
# run_qwen2_5_7b_gsm8k_math_2nodes.sh, whose launch is the same; one keeps the test suite short).
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
source "$HERE/../tiny_cpu/common.sh"
NGPUS=1 NNODES=1 MASTER_ADDR=127.0.0.1 MASTER_PORT=$(free_port) RUN_ID=tiny_cpu_$$ \
    bash "$HERE/run_qwen2_5_0_5b_gsm8k_2nodes.sh" "${TINY_ARGS[@]}" "$@"
