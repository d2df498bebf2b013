#!/usr/bin/env bash
# Tiny CPU twin of run_qwen2_5_coder_0_5b_code.sh: that script with its own keys, on the offline tiny model and the
# bundled code problems, 2 steps, one process; the tiny model's answers run in the same bubblewrap sandbox (and fail).
# needs: sandbox
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
source "$HERE/../tiny_cpu/common.sh"
NGPUS=1 NNODES=1 bash "$HERE/run_qwen2_5_coder_0_5b_code.sh" "${TINY_ARGS[@]}" "$@"
