#!/usr/bin/env bash
# Tiny CPU twin of gsm8k.sh: that script on the tiny GSM8K-format originals (64 + 16 additions),
# written into this twin's run folder.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
source "$HERE/../tiny_cpu/common.sh"
GSM8K_INPUT="$TINY_DIR/raw/gsm8k" DATA_DIR="$TINY_RUN_DIR" bash "$HERE/gsm8k.sh" "$@"
