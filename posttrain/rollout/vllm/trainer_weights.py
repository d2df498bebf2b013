"""The trainer's weights as vLLM loads them: (Hugging Face name, whole tensor) pairs, produced bucket by bucket.

The policy may be sharded (FSDP2 units: one per decoder layer, and the root's embeddings, norm and head), split by
tensor parallel (DTensor pieces) and carry LoRA adapters (peft). vLLM wants the plain checkpoint: whole tensors under
the names of the transformers model, adapters merged. So the units are grouped in order into buckets of at most
`bucket_bytes` (`rollout.update_weights_bucket_megabytes`; a larger unit alone), and per bucket its units are
gathered (FSDP's own all-gather, every rank together), each tensor is taken whole (a tensor-parallel piece joined,
an adapter's delta added to its base weight), handed on, and the bucket is freed before the next is gathered: a push
holds at most one bucket beyond the shards. An unsharded model is one bucket read in place.

Whether the weights changed since the last push is read from torch's version counters, which every in-place change
of a parameter advances (an optimizer step, a checkpoint load, a weight sync into the model).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from ...parallel.shard import base_model
from ...parallel.weight_sync import fsdp_units, units_gathered, whole


@dataclass
class _Entry:
    name: str  # the Hugging Face name
    unit: nn.Module | None  # the FSDP unit that holds it (None: not sharded)
    nbytes: int  # whole
    take: object  # () -> the whole tensor, read while its unit is gathered


def weights_fingerprint(model: nn.Module) -> tuple:
    """Changes whenever a parameter of `model` is replaced or changed in place."""
    return tuple((id(p), p._version) for p in model.parameters())


def trainer_weights(model: nn.Module, bucket_bytes: int, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """Every weight of the policy `model` by its Hugging Face name, whole, adapters merged, in `dtype` (the
    engine's). On a sharded model every rank must run this iterator to the end together (its gathers are
    collectives)."""
    entries = _entries(model)
    for bucket in _buckets(entries, bucket_bytes):
        units = list(dict.fromkeys(e.unit for e in bucket if e.unit is not None))
        with units_gathered(units):
            for entry in bucket:
                tensor = entry.take()
                yield entry.name, tensor.to(dtype) if tensor.is_floating_point() else tensor


def _entries(model: nn.Module) -> list[_Entry]:
    """The weights of `model` in order, each with the unit that holds it."""
    unit_of = fsdp_units(model)
    base = base_model(model)
    entries, seen = [], set()
    for name, module in base.named_modules():
        unit = unit_of.get(module)
        if _is_lora(module):
            entries.append(_Entry(f"{name}.weight", unit, _nbytes(module.base_layer.weight),
                                  lambda m=module: _merged(m)))
            for pname, p in module.base_layer.named_parameters(recurse=False):
                if pname != "weight":
                    entries.append(_Entry(f"{name}.{pname}", unit, _nbytes(p),
                                          lambda m=module.base_layer, a=pname, u=unit: _whole(getattr(m, a), u)))
            seen.update(id(p) for p in module.parameters())
            continue
        for pname, p in module.named_parameters(recurse=False):
            if id(p) in seen:  # a tied weight, or one of an adapter's
                continue
            seen.add(id(p))
            entries.append(_Entry(f"{name}.{pname}" if name else pname, unit, _nbytes(p),
                                  lambda m=module, a=pname, u=unit: _whole(getattr(m, a), u)))
    return entries


def _is_lora(module: nn.Module) -> bool:
    return hasattr(module, "base_layer") and hasattr(module, "get_delta_weight")


def _nbytes(p: torch.Tensor) -> int:
    return p.numel() * p.element_size()  # a DTensor's numel is the whole tensor's


def _whole(t: torch.Tensor, unit) -> torch.Tensor:
    """`t` whole: a tensor-parallel piece joined; a gathered FSDP parameter copied (its storage is freed when the
    unit is resharded, and vLLM may hold a tensor until its layer is complete)."""
    t = t.detach()
    if hasattr(t, "full_tensor"):
        return whole(t)
    return t.clone() if unit is not None else t


@torch.no_grad()
def _merged(module: nn.Module) -> torch.Tensor:
    """A LoRA layer's base weight plus its active adapters' deltas (peft's own `get_delta_weight`)."""
    weight = _whole(module.base_layer.weight, None).clone()
    for adapter in module.active_adapters:
        if adapter in getattr(module, "lora_A", {}) or adapter in getattr(module, "lora_embedding_A", {}):
            weight += whole(module.get_delta_weight(adapter)).to(weight.dtype)
    return weight


def _buckets(entries: list[_Entry], bucket_bytes: int) -> list[list[_Entry]]:
    """Entries grouped by unit, units in order of first appearance, consecutive units into buckets of at most
    `bucket_bytes` (a larger unit alone)."""
    by_unit: dict = {}
    for e in entries:
        by_unit.setdefault(id(e.unit), []).append(e)
    buckets, current, size = [], [], 0
    for group in by_unit.values():
        n = sum(e.nbytes for e in group)
        if current and size + n > bucket_bytes:
            buckets.append(current)
            current, size = [], 0
        current += group
        size += n
    if current:
        buckets.append(current)
    return buckets
