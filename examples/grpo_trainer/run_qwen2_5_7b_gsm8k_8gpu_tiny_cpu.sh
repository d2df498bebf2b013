#!/usr/bin/env bash
# Tiny CPU twin of run_qwen2_5_7b_gsm8k_8gpu.sh: that script with its own keys, on the offline tiny model and data,
# 2 steps, in one process (its 8-GPU launch is the same as run_qwen2_5_0_5b_gsm8k_8gpu.sh's, whose twin runs it as 2
# CPU processes; one process keeps the test suite short).
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
source "$HERE/../tiny_cpu/common.sh"
NGPUS=1 NNODES=1 bash "$HERE/run_qwen2_5_7b_gsm8k_8gpu.sh" "${TINY_ARGS[@]}" "$@"
