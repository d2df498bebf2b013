"""Starting vLLM's engine inside a training process, leaving the process as it found it (engine.py builds on it)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Mapping
from pathlib import Path

import torch

from .settings import EngineSettings


def tensor_parallel_group():
    """The gloo group of this rank's vLLM tensor-parallel group (its members must generate the same prompts)."""
    from vllm.distributed.parallel_state import get_tp_group

    return get_tp_group().cpu_group


def free_segment_names() -> None:
    """vLLM's CPU tensor-parallel groups talk through shared-memory segments named after the group alone (the same
    names in every job on the machine), which it never removes: the next run, or another job at the same time, fails
    to create them (`create shm in SHMManager failed. errno: 17`). Once the engine has started every member has
    opened every segment of its group, so each removes the name of its own (the memory stays until the process
    ends)."""
    from vllm.distributed import parallel_state

    for ref in list(parallel_state._groups.values()):
        group = ref()
        segment = getattr(getattr(group, "device_communicator", None), "dist_module", None)
        name = getattr(segment, "group_name", None)
        if isinstance(name, str):  # shm_open's name: leading slashes dropped
            (Path("/dev/shm") / f"{name.lstrip('/')}_{group.rank_in_group}").unlink(missing_ok=True)


def check_head_size(config, device_type: str) -> None:
    """vLLM's CPU attention has kernels for some head sizes only; with another the engine starts and then fails at
    its first generate call, deep in vLLM. Refused before it starts, with what to do instead."""
    if device_type != "cpu":
        return
    env = dict(os.environ)
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend  # imports vLLM's ROCm ops, which set AITER_*

    _restore_environment(env)

    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    head = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    supported = CPUAttentionBackend.get_supported_head_sizes()
    if head not in supported:
        raise ValueError(f"actor_rollout_ref.rollout.name=vllm: vLLM's CPU attention has no kernel for this model's "
                         f"head size {head} (it has {', '.join(map(str, supported))}); use rollout.name=posttrain")


def start_llm(settings: EngineSettings, *, device_type: str, distributed: bool):
    """vLLM's `LLM`, its worker in this process. What its start-up changes in the process is put back after it:
    the random generators it seeds (Python's, NumPy's, torch's: the trainer seeds them per step, and vLLM's sampling
    is seeded per call), and what its CPU platform prepares for worker processes it would start
    (LD_PRELOAD, LOCAL_WORLD_SIZE, thread variables, `torch.set_num_threads` replaced)."""
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # read when vllm is first imported
    from vllm import LLM
    from vllm.platforms import current_platform

    if current_platform.device_type != device_type:
        raise ValueError(f"actor_rollout_ref.rollout.name=vllm: the installed vLLM runs on "
                         f"{current_platform.device_type or 'no device'}, the trainer on {device_type}; install "
                         "the vLLM build of the trainer's device (docs/rollout_engines.md)")
    _scan_sees_mappings()
    env, set_threads, generators = dict(os.environ), torch.set_num_threads, _generator_states()
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core and its worker in this process
    try:
        # quiet: the chat-template warm-up's traceback (vLLM has no tokenizer here: token ids in and out) and the
        # CPU worker's advice on preloading libraries into processes it does not start here
        with quiet("vllm.renderers.base", "vllm.v1.worker.cpu_worker"):
            return LLM(**settings.llm_kwargs(device_type=device_type, distributed=distributed))
    finally:
        _restore_environment(env)
        torch.set_num_threads = set_threads
        _restore_generators(generators)


def _restore_environment(env: dict) -> None:
    """The process's environment variables back to `env`: what vLLM sets for processes it does not start here."""
    for key in set(os.environ) - set(env):
        del os.environ[key]
    for key, value in env.items():
        if os.environ.get(key) != value:
            os.environ[key] = value


def _scan_sees_mappings() -> None:
    """vLLM's CPU worker rebinds its kernel overrides by scanning the objects of every imported module with
    `vars()`, and stops on an object whose `__dict__` is not a mapping: llvmlite's `ffi.lib`, imported (with numba)
    once any vLLM engine has run in the process, so a second engine in one process would not start. The scan gets
    an empty mapping for such an object: it holds no kernel."""
    try:
        from vllm.triton_utils import dispatcher
    except ImportError:  # a vLLM without the scan
        return

    def mapping_vars(value) -> Mapping:
        namespace = vars(value)
        return namespace if isinstance(namespace, Mapping) else {}

    dispatcher.vars = mapping_vars  # the module's global shadows the builtin inside its functions


def _generator_states() -> tuple:
    import random

    import numpy as np

    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    return random.getstate(), np.random.get_state(), torch.get_rng_state(), cuda


def _restore_generators(states: tuple) -> None:
    import random

    import numpy as np

    python, numpy, cpu, cuda = states
    random.setstate(python)
    np.random.set_state(numpy)
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state_all(cuda)


@contextlib.contextmanager
def quiet(*loggers: str):
    """These loggers pass on only errors for a block (a filter: vLLM re-applies its logging config, levels
    included, while its engine starts)."""
    import logging

    def errors_only(record: logging.LogRecord) -> bool:
        return record.levelno >= logging.ERROR

    for name in loggers:
        logging.getLogger(name).addFilter(errors_only)
    try:
        yield
    finally:
        for name in loggers:
            logging.getLogger(name).removeFilter(errors_only)
