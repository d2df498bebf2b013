#!/usr/bin/env bash
# The checks only a GPU can make, on one NVIDIA GPU, in two sections of about 6 minutes each (one device call each;
# SECTIONS="speed checks" by default; write the numbers into docs/performance.md):
# speed (docs/performance.md, "On a GPU: against the physical limits"):
#   1. decoding against its bandwidth bound: one decoding step of the L (Qwen2.5-0.5B-shaped) and 1.5B-shaped random
#      models in bf16 at batch 64 / 128 / 256 (distinct 512-token prompts), against (weight + key/value bytes) /
#      the copy bandwidth measured in the same run (benchmarks/decode_bound.py);
#   2. the GRPO step of model L in bf16 with the actor's layers compiled and eager: the training phase's share of
#      the measured matmul ceiling (benchmarks/grpo_step.py, posttrain-compile / posttrain-nocompile);
# checks (docs/performance.md, "Long responses"):
#   3. the CUDA tests: the packed half-precision forward on torch's varlen kernel against float64 and the padded
#      forward, and CUDA-graph decoding;
#   4. the actor's training pass on the long-tail mix (median 1k, tail 16k, model M, bf16): packed on the varlen
#      kernel, packed on per-row sdpa, and padded micro-batches, side by side;
#   5. decoding at 8k, 16k and 32k contexts (model M, bf16, CUDA graphs);
#   6. the one-time checks that switch the packed and shared-prompt paths on, for model M in bf16 and fp16: how far
#      each fast path is from the padded forward on the GPU's kernels, against what the check allows.
# Run from the repository root: `bash tools/gpu_check.sh` (or `SECTIONS=speed bash tools/gpu_check.sh`); results go
# to $OUT (or ./gpu_check).
# Python packages the machine lacks (see machine.txt) are installed from ./.whl when it is there (ignored by git;
# name it in the call's carry), made here with `pip download --no-deps -d .whl <packages>`.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-gpu_check}
sections=${SECTIONS:-speed checks}
mkdir -p "$out"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
if [ -d .whl ]; then
  python -m pip install -q --no-index --no-deps .whl/*.whl 2>&1 | tail -3
fi
{ nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
  python -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
} 2>&1 | tee "$out/machine.txt"
python - <<'EOF' 2>&1 | tee -a "$out/machine.txt"
import importlib.util
wanted = ["transformers", "tokenizers", "peft", "safetensors", "pyarrow", "omegaconf", "yaml", "math_verify", "rich",
          "tensorboard", "matplotlib", "pytest"]
missing = [m for m in wanted if importlib.util.find_spec(m) is None]
print("missing python packages:", ", ".join(missing) or "none")
EOF

if [[ " $sections " == *" speed "* ]]; then
timeout 200 python benchmarks/decode_bound.py --device cuda --models L,1.5B --batches 64,128,256 --dtype bf16 2>&1 \
  | tail -10 | tee "$out/decode_bound.txt"
timeout 300 python benchmarks/grpo_step.py --device cuda --models L --dtypes bf16 \
  --frameworks posttrain-compile,posttrain-nocompile --steps 3 --warmup 1 --repeats 1 2>&1 | tail -20 \
  | tee "$out/grpo_step_compile.txt"
fi
[[ " $sections " == *" checks "* ]] || exit 0

timeout 180 python -m pytest -q -p no:cacheprovider tests/test_fast_paths.py tests/test_packed.py \
  tests/test_decode_state.py -k "cuda or varlen" 2>&1 | tail -30 | tee "$out/tests.txt"
timeout 60 python - <<'EOF' 2>&1 | tail -8 | tee "$out/checks.txt"
# the one-time checks that switch the packed and shared-prompt paths on, on model M computing in half precision
import logging, sys
sys.path.insert(0, "benchmarks")
logging.basicConfig(level=logging.WARNING, format="%(message)s")
logging.getLogger("posttrain.models.shared_prompt").setLevel(logging.DEBUG)
from long_context import model_m
from posttrain.models.policy import PolicyModel
for dtype in ("bf16", "fp16"):
    model = PolicyModel(model_m(64, device="cuda", dtype=dtype))
    print(dtype, "packed:", model.packs(), "| prompts shared, packed:", model._shares_prompts(True), flush=True)
EOF
timeout 240 python benchmarks/long_context.py --device cuda --dtype bf16 --variants packed,packed-sdpa,padded 2>&1 \
  | tail -12 | tee "$out/long_context.txt"
timeout 120 python benchmarks/long_context.py --device cuda --dtype bf16 --decode --decode-model M \
  --contexts 8192,16384,32768 2>&1 | tail -8 | tee "$out/decode.txt"
