"""Rollout engines by name (`actor_rollout_ref.rollout.name`).

`posttrain` is posttrain's decoding engine (engine.py), `hf` transformers' `generate` (transformers_generate.py) and
`vllm` vLLM's offline engine (vllm/, imported only when built). The names of engines posttrain does not have (SGLang,
TensorRT-LLM: verl configs name them) run on `posttrain`, with a note when the config loads. Another engine joins
with `@register("name")` on a function building it from the same arguments.
"""

from __future__ import annotations

from typing import Callable

from .base import RolloutEngine
from .engine import DecodeEngine
from .transformers_generate import TransformersGenerate

ENGINES: dict[str, Callable[..., RolloutEngine]] = {}


def register(*names: str):
    """Decorator: `factory(model, tokenizer, *, device, dtype, micro_batch_size, enforce_eager, config)` under
    `names` (`config`: the run's config, None outside a run)."""
    def add(factory):
        for name in names:
            if name in ENGINES:
                raise ValueError(f"a rollout engine named {name!r} is already registered")
            ENGINES[name] = factory
        return factory
    return add


@register("posttrain", "sglang", "trtllm")
def _posttrain(model, tokenizer, *, enforce_eager: bool = False, config=None, **settings) -> RolloutEngine:
    return DecodeEngine(model, tokenizer, cuda_graphs=not enforce_eager, **settings)


@register("hf")
def _transformers(model, tokenizer, *, enforce_eager: bool = False, config=None, **settings) -> RolloutEngine:
    return TransformersGenerate(model, tokenizer, **settings)


@register("vllm")
def _vllm(model, tokenizer, *, enforce_eager: bool = False, config=None, **settings) -> RolloutEngine:
    from ..models.hub import resolve_model_source
    from .vllm import INSTALL, installed

    if config is None:
        raise ValueError("the vllm rollout engine is built from a run's config (build_engine(..., config=cfg))")
    if not installed():
        raise ImportError(f"actor_rollout_ref.rollout.name=vllm needs vLLM: {INSTALL}")
    from .vllm.engine import VLLMEngine
    from .vllm.settings import EngineSettings

    key = "actor_rollout_ref.model.path"
    path = resolve_model_source(config.actor_rollout_ref.model.path, key=key)
    return VLLMEngine(model, tokenizer, settings=EngineSettings.from_config(config, model_path=path,
                                                                           dtype=settings["dtype"]), **settings)


def build_engine(name: str, model, tokenizer, *, device, dtype, micro_batch_size: int | None = None,
                 enforce_eager: bool = False, config=None) -> RolloutEngine:
    """The engine registered as `name`, over `model` (the policy whose weights it samples with); `config`: the
    run's config, which an engine with settings of its own (vLLM's) reads them from."""
    if name not in ENGINES:
        raise ValueError(f"actor_rollout_ref.rollout.name={name!r}: no such rollout engine "
                         f"(known: {', '.join(sorted(ENGINES))})")
    return ENGINES[name](model, tokenizer, device=device, dtype=dtype, micro_batch_size=micro_batch_size,
                         enforce_eager=enforce_eager, config=config)
