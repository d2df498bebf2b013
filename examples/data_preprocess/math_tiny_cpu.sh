#!/usr/bin/env bash
# Tiny CPU twin of math.sh: that script on the tiny MATH-500-format original (16 additions, test split),
# written into this twin's run folder.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
source "$HERE/../tiny_cpu/common.sh"
MATH_INPUT="$TINY_DIR/raw/math500" DATA_DIR="$TINY_RUN_DIR" bash "$HERE/math.sh" "$@"
