#!/usr/bin/env bash
# Tiny CPU twin of code.sh: that script on the bundled problems, as the script itself does,
# written into this twin's run folder.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
source "$HERE/../tiny_cpu/common.sh"
DATA_DIR="$TINY_RUN_DIR" bash "$HERE/code.sh" "$@"
