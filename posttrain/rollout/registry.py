"""Rollout engines by name (`actor_rollout_ref.rollout.name`).

`posttrain` is posttrain's decoding engine (engine.py) and `hf` transformers' `generate` (transformers_generate.py).
The names of engines posttrain does not have (vLLM, SGLang, TensorRT-LLM: verl configs name them) run on
`posttrain`. Another engine joins with `@register("name")` on a function building it from the same arguments.
"""

from __future__ import annotations

from typing import Callable

from .base import RolloutEngine
from .engine import DecodeEngine
from .transformers_generate import TransformersGenerate

ENGINES: dict[str, Callable[..., RolloutEngine]] = {}


def register(*names: str):
    """Decorator: `factory(model, tokenizer, *, device, dtype, micro_batch_size, enforce_eager)` under `names`."""
    def add(factory):
        for name in names:
            if name in ENGINES:
                raise ValueError(f"a rollout engine named {name!r} is already registered")
            ENGINES[name] = factory
        return factory
    return add


@register("posttrain", "vllm", "sglang", "trtllm")
def _posttrain(model, tokenizer, *, enforce_eager: bool = False, **settings) -> RolloutEngine:
    return DecodeEngine(model, tokenizer, cuda_graphs=not enforce_eager, **settings)


@register("hf")
def _transformers(model, tokenizer, *, enforce_eager: bool = False, **settings) -> RolloutEngine:
    return TransformersGenerate(model, tokenizer, **settings)


def build_engine(name: str, model, tokenizer, *, device, dtype, micro_batch_size: int | None = None,
                 enforce_eager: bool = False) -> RolloutEngine:
    """The engine registered as `name`, over `model` (the policy whose weights it samples with)."""
    if name not in ENGINES:
        raise ValueError(f"actor_rollout_ref.rollout.name={name!r}: no such rollout engine "
                         f"(known: {', '.join(sorted(ENGINES))})")
    return ENGINES[name](model, tokenizer, device=device, dtype=dtype, micro_batch_size=micro_batch_size,
                         enforce_eager=enforce_eager)
