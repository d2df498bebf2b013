"""`use_torch_compile`: each decoder layer's forward (and so its backward) compiled by `torch.compile`, as torchtitan
compiles its blocks.

- One compiled function serves every layer: the layer class's own `forward`, compiled once with dynamic shapes, is
  called with each layer (its weights are inputs of the graph, not constants), so a model of 24 layers compiles once
  and a new sequence length or batch size does not compile again.
- Only the passes that train run compiled (forward and backward under autograd). Passes without gradients (old and
  reference log-probs, the one-time checks) and calls that carry a decoding cache (`past_key_values`: the rollout
  engine's prefill and decoding steps) run the eager forward: each mode or set of arguments is a graph of its own,
  whose compile time a forward pass would not earn back, and decoding keeps its own kernels.
- Each layer keeps its modules and hooks; only its class gains a `forward` (a subclass, as FSDP2 gives it one).
  FSDP2's gather and reshard hooks, peft's LoRA layers, gradient checkpointing (which calls the layer, and so its
  forward, again in backward) and packed rows work as in eager mode. posttrain's shared-prompt / packed attention
  function runs eagerly between the compiled parts (models/shared_prompt.py says why).
- A compilation that fails (no C++ compiler, an operation the compiler does not support) warns once and the model
  runs eagerly from then on; training goes on.
"""

from __future__ import annotations

import functools
import warnings

import torch
from torch import nn

# `use_torch_compile: null` compiles a model of at least this many parameters that trains in float32 on a CPU: there
# the measured gain pays for the compilation within about ten steps. A smaller model, or bf16 compute (M's training
# phase gained 1.10x, about 0.3 s a step against 38 s of compilation: 130 steps), would make a 40-step run slower;
# on a GPU null stays eager until measured there (docs/performance.md).
AUTO_FROM_PARAMETERS = 20_000_000


def compile_wanted(setting: bool | None, model: nn.Module, device: torch.device, dtype: torch.dtype) -> bool:
    """`use_torch_compile` resolved for `model` computing in `dtype` on `device` (null: see AUTO_FROM_PARAMETERS)."""
    if setting is not None:
        return bool(setting)
    return (device.type == "cpu" and dtype == torch.float32
            and sum(p.numel() for p in model.parameters()) >= AUTO_FROM_PARAMETERS)


# Where a compiled layer's class keeps its `LayerCompiler` (a class attribute: a copy of the model, such as the
# decoding copy of rollout/weights.py, shares it and never holds a compiled function of its own).
COMPILED = "posttrain_compiler"


class LayerCompiler:
    """The compiled forward shared by a model's decoder layers, and whether compilation has failed."""

    def __init__(self, forward):
        self.compiled = torch.compile(forward, dynamic=True)
        self.failure: str | None = None

    def __call__(self, layer: nn.Module, eager, args, kwargs):
        if self.failure is not None or not torch.is_grad_enabled() or kwargs.get("past_key_values") is not None:
            return eager(*args, **kwargs)
        try:
            return self.compiled(layer, *args, **kwargs)
        except torch._dynamo.exc.TorchDynamoException as e:  # the compiler failed; the eager forward still runs
            cause = getattr(e, "inner_exception", None) or e.__cause__ or e  # the backend's own error
            first = (str(cause).strip().splitlines() or [""])[0]
            self.failure = f"{type(e).__name__}: {type(cause).__name__}: {first}"[:300]
            warnings.warn(f"use_torch_compile: compiling the decoder layers failed ({self.failure}); the model runs "
                          "eagerly", RuntimeWarning, stacklevel=2)
            return eager(*args, **kwargs)


def compile_decoder_layers(layers: list[nn.Module]) -> LayerCompiler:
    """Route each of `layers` (one class) through one compiled forward; see the module's docstring. Each layer gets
    a subclass of its class (as FSDP2 gives it one) whose `forward` chooses compiled or eager."""
    classes = {type(layer) for layer in layers}
    if len(classes) != 1:
        raise ValueError(f"use_torch_compile: the decoder layers are of several classes "
                         f"({sorted(c.__name__ for c in classes)})")
    cls = next(iter(classes))
    if hasattr(cls, COMPILED):
        return getattr(cls, COMPILED)
    compiler = LayerCompiler(cls.forward)

    def forward(self, *args, **kwargs):
        return compiler(self, super(compiled_cls, self).forward, args, kwargs)

    compiled_cls = type(f"Compiled{cls.__name__}", (cls,), {"forward": functools.wraps(cls.forward)(forward),
                                                            COMPILED: compiler})
    for layer in layers:
        layer.__class__ = compiled_cls
    return compiler


def compiler_of(model: nn.Module) -> LayerCompiler | None:
    """The `LayerCompiler` of `model`'s layers, or None when they run eagerly."""
    return next((getattr(m, COMPILED) for m in model.modules() if hasattr(type(m), COMPILED)), None)
