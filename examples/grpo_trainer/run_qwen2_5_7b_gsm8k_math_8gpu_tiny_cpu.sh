#!/usr/bin/env bash
# Tiny CPU twin of run_qwen2_5_7b_gsm8k_math_8gpu.sh: that script with its own keys, on the offline tiny model and
# data, 2 steps, 2 CPU processes (gloo) started by `posttrain train` itself in place of the 8 GPU workers.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
source "$HERE/../tiny_cpu/common.sh"
NGPUS=2 NNODES=1 bash "$HERE/run_qwen2_5_7b_gsm8k_math_8gpu.sh" "${TINY_ARGS[@]}" "$@"
