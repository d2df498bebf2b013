"""The weights decoding runs with: the trained model's, in the compute dtype.

Training keeps float32 master weights and runs its passes under autocast, which casts every weight once per
forward pass (a mini-batch's micro-batches share one set of casts: roles/common.casts_kept). A decoding step is one
token per row, so a cast per step would cost more than the step's own arithmetic (measured on the M model of
benchmarks/grpo_step.py: 2.0 of 8.2 s of generation went to copies). Decoding therefore runs on a
copy cast once per generate call (and LoRA adapters merged into it), which is freed afterwards — what a separate
inference engine holds as its own weights. A sharded model is used as it is: gathering its units already gives
parameters in FSDP's compute dtype.
"""

from __future__ import annotations

import contextlib
import copy

import torch
from torch import nn

from ..parallel import is_sharded


def _merged(model: nn.Module) -> nn.Module:
    """LoRA adapters folded into the base weights (peft), anywhere in `model`."""
    for name, child in model.named_children():
        if hasattr(child, "merge_and_unload"):
            setattr(model, name, child.merge_and_unload())
        else:
            _merged(child)
    return model.merge_and_unload() if hasattr(model, "merge_and_unload") else model


@contextlib.contextmanager
def inference_weights(model: nn.Module, dtype: torch.dtype):
    """`model` itself when it is sharded or already in `dtype`; else an eval-mode copy in `dtype`."""
    floating = [p for p in model.parameters() if p.is_floating_point()]
    if is_sharded(model) or all(p.dtype == dtype for p in floating):
        yield model
        return
    clone = _merged(copy.deepcopy(model)).to(dtype).eval()
    for p in clone.parameters():
        p.requires_grad_(False)
    try:
        yield clone
    finally:
        del clone


_WRAPPER = "base_model.model."  # peft's prefix, gone from the names of a merged copy


@torch.no_grad()
def refresh_copy(decoding: nn.Module, model: nn.Module, names: list[str]) -> None:
    """After `model`'s parameters `names` changed (a weight push mid-generation), the same change in `decoding`,
    its copy made by `inference_weights`: each tensor copied by name (and cast), and a changed LoRA adapter merged
    again into the weight it adapts, as the copy was made: base weight + the adapters' delta, then cast."""
    params = dict(decoding.named_parameters())
    lora = {name: m for name, m in model.named_modules() if hasattr(m, "get_delta_weight") and hasattr(m, "base_layer")}
    merged = set()
    for name in names:
        owner = next((m for m in lora if name.startswith(m + ".")), None)
        if owner is None:
            target = name.replace(_WRAPPER, "")
            if target not in params:
                raise RuntimeError(f"partial rollout: the decoding weights have no tensor {target} (for {name})")
            params[target].copy_(model.get_parameter(name))
        elif owner not in merged:
            merged.add(owner)
            module = lora[owner]
            target = owner.replace(_WRAPPER, "") + ".weight"
            if target not in params:
                raise RuntimeError(f"partial rollout: the decoding weights have no tensor {target} to merge the "
                                   f"adapters of {owner} into")
            weight = module.base_layer.weight.detach().clone()
            for adapter in module.active_adapters:
                if adapter in getattr(module, "lora_A", {}) or adapter in getattr(module, "lora_embedding_A", {}):
                    weight += module.get_delta_weight(adapter).to(weight.dtype)
            params[target].copy_(weight)
