#!/usr/bin/env bash
# Installs posttrain, its test tools, its optional tool libraries (the `agents` extra), the server's HTTP stack
# (the `serve` extra) and its structured output (the `structured` extra), verifiers environments (the `verifiers`
# extra) and reasoning-gym's tasks (the `reasoning-gym` extra) into the current Python.
# torch comes first: an existing torch (e.g. a CUDA build) is kept; otherwise torch==2.13.0 is installed, which on a
# fresh CPU machine of the kind posttrain is developed on resolves to the CPU build kept on local disk.
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}
if ! "$PY" -c "import torch" >/dev/null 2>&1; then
  "$PY" -m pip install --no-cache-dir -q "torch==2.13.0"
fi
"$PY" -m pip install --no-cache-dir -q -e ".[dev,agents,serve,structured,verifiers,reasoning-gym]"
