#!/usr/bin/env bash
# Tiny CPU twin of run_qwen2_5_3b_math_code_interpreter.sh: that script with its own keys, on the offline tiny model
# and data (the tool-agent layout), 2 steps, one process.
# needs: sandbox
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
source "$HERE/../tiny_cpu/common.sh"
NGPUS=1 NNODES=1 bash "$HERE/run_qwen2_5_3b_math_code_interpreter.sh" "${TINY_ARGS[@]}" "$@"
