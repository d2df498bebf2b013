"""Load a local Hugging Face causal LM and its tokenizer, and pick the device and compute dtype."""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch
from transformers.utils import logging as hf_logging

hf_logging.disable_progress_bar()  # per-file load/save bars drown the training output


def pick_device(name: str = "auto") -> torch.device:
    if name == "cuda" or (name == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise RuntimeError("trainer.device=cuda but no CUDA device is available")
        return torch.device("cuda")
    return torch.device("cpu")


def bf16_supported(device: torch.device) -> bool:
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    check = getattr(torch.cpu, "_is_avx512_bf16_supported", None) or getattr(torch.cpu, "_is_amx_tile_supported", None)
    return bool(check and check())


def compute_dtype(name: str, device: torch.device) -> torch.dtype:
    """`auto` = bf16 where the hardware runs it natively, else fp32."""
    table = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16,
             "fp32": torch.float32, "float32": torch.float32}
    if name == "auto":
        return torch.bfloat16 if bf16_supported(device) else torch.float32
    return table[name]


def autocast(device: torch.device, dtype: torch.dtype):
    """Mixed precision around forward passes; weights and optimizer state stay fp32."""
    if dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


def load_tokenizer(path: str, trust_remote_code: bool = False):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def load_causal_lm(path: str, *, device: torch.device, trust_remote_code: bool = False,
                   override_config: dict | None = None, gradient_checkpointing: bool = False):
    """fp32 weights on `device` (mixed precision comes from autocast), optional gradient checkpointing."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if not Path(path).is_dir():
        raise FileNotFoundError(f"model path '{path}' is not a local directory (posttrain never downloads weights)")
    config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    for key, value in (override_config or {}).items():
        setattr(config, key, value)
    model = AutoModelForCausalLM.from_pretrained(path, config=config, dtype=torch.float32,
                                                 trust_remote_code=trust_remote_code).to(device)
    if gradient_checkpointing:
        enable_checkpointing(model)
        model.config.use_cache = False
    return model


def enable_checkpointing(model) -> None:
    """Activation checkpointing under whichever name this transformers version uses."""
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
