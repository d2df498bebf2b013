"""A role's model across processes: tensor parallel inside each layer, FSDP2 (`fully_shard`) over the
data-parallel ranks, weights loaded once and scattered, and the few operations sharding changes (generation,
gradient clipping, gradient sync between micro-batches).

Order of `parallelize` (as in torchtitan): tensor-parallel plan -> `fully_shard` per decoder layer -> `fully_shard`
of the root. Activation checkpointing is the model's own (transformers' gradient checkpointing), switched on before.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from .context import Parallel, peer_count, peer_group


@dataclass(frozen=True)
class ShardSettings:
    """One role's FSDP2 settings, resolved from its `fsdp_config`."""

    param_dtype: torch.dtype | None = None  # compute / all-gather dtype (MixedPrecisionPolicy); None = model dtype
    reduce_dtype: torch.dtype | None = torch.float32  # gradient reduction dtype
    offload: bool = False  # parameters, gradients and optimizer state live on the CPU (CPUOffloadPolicy)
    reshard_after_forward: bool = True  # free gathered layers after forward (False trades memory for speed)


# A sharded layer's own reshard_after_forward, which generation turns off and back on: FSDP2 can set it but not
# report it.
RESHARD_AFTER_FORWARD = "posttrain_reshard_after_forward"


# ------------------------------------------------------------------ structure of a transformers model


def base_model(model: nn.Module) -> nn.Module:
    """The transformers PreTrainedModel inside our wrappers and peft."""
    inner = next((m for m in (getattr(model, "lm", None), getattr(model, "backbone", None)) if m is not None), model)
    get_base = getattr(inner, "get_base_model", None)
    return get_base() if callable(get_base) else inner


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks FSDP shards one by one: modules whose class transformers marks as not splittable (or a
    subclass of it: FSDP2's and use_torch_compile's per-layer classes)."""
    names = set(getattr(base_model(model), "_no_split_modules", None) or [])
    layers = [m for m in model.modules() if any(c.__name__ in names for c in type(m).__mro__)]
    if not layers:
        raise ValueError(f"{type(base_model(model)).__name__} does not name its decoder layer class "
                         "(_no_split_modules); posttrain cannot shard it layer by layer")
    return layers


def is_moe_config(config) -> bool:
    """A mixture-of-experts model's config (experts with top-k routing): its experts are what the tensor-parallel plan
    does not split."""
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    return bool((getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None))
                and getattr(config, "num_experts_per_tok", None))


def apply_tensor_parallel(model: nn.Module, par: Parallel) -> None:
    """Split attention and MLP projections over the tp mesh with the model's own plan (`base_model_tp_plan`:
    colwise for q/k/v and gate/up, rowwise for o and down). Embeddings, norms and the output head stay whole on
    every tp rank (FSDP still shards them over data-parallel ranks), so log-probs need no vocabulary-split softmax."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    base = base_model(model)
    config = base.config.get_text_config() if hasattr(base.config, "get_text_config") else base.config
    plan = getattr(config, "base_model_tp_plan", None) or getattr(base, "_tp_plan", None)
    if not plan:
        raise ValueError(f"{type(base).__name__} has no tensor-parallel plan (config.base_model_tp_plan); "
                         "use fsdp_config.tp_size=1")
    if is_moe_config(config):
        raise ValueError(f"tensor parallel: {type(base).__name__} is a mixture-of-experts model and posttrain's "
                         "tensor-parallel plan does not split its experts (fused expert weights, router); use "
                         "fsdp_config.tp_size=1 — FSDP2 shards the experts with the rest of each decoder layer "
                         "(docs/scaling.md)")
    tp = par.dims.tp
    for key in ("num_attention_heads", "num_key_value_heads"):
        heads = getattr(config, key, None)
        if heads is not None and heads % tp:
            raise ValueError(f"tensor parallel: {key}={heads} is not divisible by tp_size={tp}")
    # a vocabulary-split embedding (transformers adds it to the plans of models with tied embeddings) is left out:
    # the embedding stays whole, as the head it is tied to
    plan = {key: style for key, style in plan.items() if style != "embedding_rowwise"}
    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    unsupported = sorted({v for v in plan.values() if v not in styles})
    if unsupported:
        raise ValueError(f"tensor parallel: the {config.model_type} plan uses {unsupported}; posttrain supports "
                         "models whose plan is colwise/rowwise only (Llama, Qwen2, Mistral, ...); use tp_size=1")
    decoder = _decoder_of(model)
    parallelize_module(decoder, par.tp_mesh, {key: styles[style]() for key, style in plan.items()})


def _decoder_of(model: nn.Module) -> nn.Module:
    """The module the tp plan keys (`layers.*.self_attn.q_proj`) are relative to."""
    base = base_model(model)
    if getattr(model, "backbone", None) is not None:  # a value model: the backbone is the decoder
        return base
    for name in ("model", "transformer", "language_model"):
        dec = getattr(base, name, None)
        if isinstance(dec, nn.Module):
            return dec
    raise TypeError(f"cannot find the decoder of {type(base).__name__}")


def parallelize(model: nn.Module, par: Parallel, settings: ShardSettings) -> nn.Module:
    """Tensor parallel (if tp > 1), then FSDP2 per decoder layer and at the root; gradients are *summed* over
    data-parallel ranks, because each rank's loss is already its share of the global loss, and averaged over row
    replicas (ParallelDims.replicas), each of which computes the same share."""
    from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    if par.dims.tp > 1:
        apply_tensor_parallel(model, par)
    if par.dims.sp > 1:
        from .ulysses import check_model

        check_model(base_model(model).config, par.dims.sp)
    mp = MixedPrecisionPolicy(param_dtype=settings.param_dtype, reduce_dtype=settings.reduce_dtype)
    offload = CPUOffloadPolicy(pin_memory=par.device.type == "cuda") if settings.offload else OffloadPolicy()
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=par.fsdp_mesh, mp_policy=mp, offload_policy=offload,
                    reshard_after_forward=settings.reshard_after_forward)
        setattr(layer, RESHARD_AFTER_FORWARD, settings.reshard_after_forward)
    fully_shard(model, mesh=par.fsdp_mesh, mp_policy=mp, offload_policy=offload)
    from torch.distributed.fsdp import register_fsdp_forward_method

    for method in ("generate", "lm_forward"):  # decoding enters through the root, as forward does (FSDP initialises there)
        if hasattr(model, method):
            register_fsdp_forward_method(model, method)
    for module in model.modules():  # a sum, except over row replicas, which each compute the whole gradient
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(float(par.dims.replicas))
            module.set_force_sum_reduction_for_comms(True)
    return model


def prepare_model(build, par: Parallel, settings: ShardSettings | None) -> nn.Module:
    """Build a role's model where it will run. `build(meta)` returns the model: with real weights, or on the meta
    device (no memory). In one process: the real model on the device. Sharded: every rank lays out the meta
    structure (tensor-parallel split, FSDP shards); rank 0 alone reads the weights, and they are broadcast into the
    shards, so no rank but rank 0 ever holds the full model. When the peers are a group of the job (asynchronous
    RL's training processes) every rank reads the weights and keeps its shards: torch's broadcast from rank 0 runs
    over the whole job, whose generating processes do not take part."""
    if not par.distributed:
        return build(False).to(par.device)
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    everyone = peer_group() is None
    full, buffers = {}, {}
    if par.rank == 0 or not everyone:
        real = build(False)
        full, buffers = real.state_dict(), dict(real.named_buffers())
        del real
    model = build(True)
    parallelize(model, par, settings or ShardSettings())
    model.to_empty(device="cpu" if settings and settings.offload else par.device)
    for module in model.modules():  # buffers are used where compute runs, also when the weights live on the CPU
        for name, buffer in module._buffers.items():
            if buffer is not None:
                module._buffers[name] = buffer.to(par.device)
    set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=everyone))
    del full
    for name, buffer in model.named_buffers():  # non-persistent buffers (rotary frequencies) are not in the state
        if par.rank == 0 or not everyone:
            buffer.data.copy_(buffers[name].to(buffer.device))
        if everyone:
            dist.broadcast(buffer.data, src=0)
    return model


def is_sharded(model: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def tensor_parallel(model: nn.Module) -> bool:
    """Does `model`'s forward run collectives of its own (layers split over a tensor-parallel group)? Then the ranks
    of the group must run the same forwards, on the same rows, in the same order."""
    return _tp_mesh(model) is not None


def _tp_mesh(model: nn.Module):
    """The tensor-parallel mesh `model`'s layers are split over (None: not split)."""
    for p in model.parameters():
        mesh = getattr(p, "device_mesh", None)
        names = (mesh.mesh_dim_names or ()) if mesh is not None else ()
        if "tp" in names and mesh["tp"].size() > 1:
            return mesh["tp"]
    return None


def tensor_parallel_first(model: nn.Module) -> bool:
    """Is this process the first of `model`'s tensor-parallel group (True where the model is not split)? What the
    group must do once (an episode's environment) runs there, and `from_tensor_parallel_first` gives the others
    its result."""
    mesh = _tp_mesh(model)
    return mesh is None or mesh.get_local_rank() == 0


def from_tensor_parallel_first(obj, model: nn.Module):
    """`obj` as the first process of `model`'s tensor-parallel group holds it, on every process of the group (a
    collective of the group; the others' `obj` is ignored). The identity where the model is not split."""
    mesh = _tp_mesh(model)
    if mesh is None:
        return obj
    box = [obj if mesh.get_local_rank() == 0 else None]
    dist.broadcast_object_list(box, group=mesh.get_group(), group_src=0)
    return box[0]


def agreed(ok: bool, model: nn.Module) -> bool:
    """A one-time choice of a sharded model's code path (a fast path's check), the same on every rank: True only
    where every rank found `ok`. Ranks that chose differently would run different collectives in the model's
    forward and wait on each other for ever. A model that is not sharded decides alone."""
    if not is_sharded(model) or peer_count() == 1:
        return ok
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    flag = torch.tensor([int(ok)], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=peer_group())
    return bool(flag.item())


@contextlib.contextmanager
def gathered_for_generation(model: nn.Module):
    """Gather every FSDP unit once, keep it gathered while decoding, free it after: one all-gather per unit per
    generate call, never one per decoded token. A no-op for a model that is not sharded."""
    from torch.distributed.fsdp import FSDPModule

    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    if not units:
        yield
        return
    for unit in units:
        unit.unshard()
        unit.set_reshard_after_forward(False, recurse=False)
    try:
        yield
    finally:
        for unit in units:
            unit.reshard()
        for unit in units[1:]:  # the root (first) keeps FSDP's own root setting (no reshard after forward)
            unit.set_reshard_after_forward(getattr(unit, RESHARD_AFTER_FORWARD, True), recurse=False)


def set_gradient_sync(model: nn.Module, enabled: bool) -> None:
    """Skip the gradient reduce-scatter on all but the last micro-batch of an optimizer step."""
    if is_sharded(model):
        model.set_requires_gradient_sync(enabled)


def clip_grad_norm(parameters, max_norm: float) -> torch.Tensor:
    """Global L2 norm of the gradients (over every rank's shard and every tensor-parallel piece), and the gradients
    scaled by min(1, max_norm / (norm + 1e-6)) as torch's clip does. torch's own clip cannot mix tensors on
    different meshes (tp-split layers beside FSDP-only norms and embeddings), so squares are summed locally and
    reduced once per mesh layout."""
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return torch.zeros(())
    by_layout: dict = {}
    for g in grads:
        key = (g.device_mesh, tuple(g.placements)) if hasattr(g, "device_mesh") else None
        by_layout.setdefault(key, []).append(g)
    total_sq = torch.zeros((), dtype=torch.float64)
    for key, group in by_layout.items():
        local = [g.to_local() if key is not None else g for g in group]
        sq = torch.stack([torch.linalg.vector_norm(g, dtype=torch.float32) ** 2 for g in local]).sum()
        if key is not None:  # sum over the mesh dims a gradient is split on, not over those it is replicated on
            from torch.distributed.tensor import DTensor, Partial, Replicate

            mesh, placements = key
            sq = DTensor.from_local(sq, mesh, [Replicate() if p.is_replicate() else Partial() for p in placements],
                                    run_check=False).full_tensor()
        total_sq += sq.detach().double().cpu()
    norm = total_sq.sqrt().float()
    if math.isfinite(float(norm)):
        coef = min(max_norm / (float(norm) + 1e-6), 1.0)
        if coef < 1.0:
            for g in grads:
                g.mul_(coef)
    return norm
