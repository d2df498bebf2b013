"""Mixture-of-experts models: the router's auxiliary (load-balancing) loss as the model defines it, and router
metrics.

Why here and not the model's own `aux_loss` output: posttrain's log-prob pass may run the model twice per
micro-batch (each distinct prompt once, then the responses, see shared_prompt.py), so the router logits of both calls
are collected with the real-token mask of each — a shared prompt's tokens weighted by the number of rows that share
it — and the model's own `load_balancing_loss_func` (looked up in the model's module: Qwen2-MoE, Qwen3-MoE, Mixtral,
... define one each; it takes a weighted mask) is applied to them together. The result is the `aux_loss` the model
returns for a plain forward over the micro-batch's rows. The loss is added to the actor's loss only when the model's config asks
for it (`output_router_logits=True`), scaled by its `router_aux_loss_coef` — both settable with
`actor_rollout_ref.model.override_config`, as for any config field.

Top-k routing without an expert capacity (the Qwen MoE models) never drops a token, so there is no dropped-token
metric; the load metric shows how unevenly the experts are used instead.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch

from ..parallel.shard import is_moe_config

__all__ = ["MoeSpec", "moe_spec", "is_moe_config", "reject_tensor_parallel", "RouterRecorder", "router_off"]


@dataclass(frozen=True)
class MoeSpec:
    """What the aux loss needs from a MoE model's config."""

    num_experts: int
    top_k: int
    aux_coef: float  # router_aux_loss_coef
    aux_on: bool  # output_router_logits: the model adds the aux loss in training
    loss_fn: object  # the model module's load_balancing_loss_func


def _text_config(config):
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def moe_spec(model) -> MoeSpec | None:
    """The MoE settings of a transformers causal LM (unwrapped), or None for a dense model."""
    config = _text_config(model.config)
    experts = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None)
    top_k = getattr(config, "num_experts_per_tok", None)
    if not experts or not top_k or not hasattr(config, "output_router_logits"):
        return None
    loss_fn = getattr(sys.modules[type(model).__module__], "load_balancing_loss_func", None)
    if loss_fn is None:
        raise TypeError(f"{type(model).__name__} is a mixture-of-experts model whose module defines no "
                        "load_balancing_loss_func; posttrain cannot compute its router loss")
    return MoeSpec(int(experts), int(top_k), float(getattr(config, "router_aux_loss_coef", 0.0) or 0.0),
                   bool(config.output_router_logits), loss_fn)


def reject_tensor_parallel(config, tp_size: int, key: str) -> None:
    """A MoE model with tensor parallel is a config error, raised before any model loads: posttrain's
    tensor-parallel plan covers attention and dense MLPs only."""
    if tp_size > 1 and is_moe_config(config):
        from ..errors import ConfigError

        raise ConfigError(f"{key}={tp_size}: the model is a mixture-of-experts model ({type(config).__name__}) and "
                          "posttrain's tensor parallel does not split experts; set it to 1 — FSDP2 shards the experts "
                          "with the rest of each decoder layer over all ranks (docs/scaling.md)")


def router_off(config) -> dict:
    """Forward keyword arguments that stop a MoE model from collecting router logits and computing its aux loss in
    a call that does not train it (generation, reference log-probs); empty for a dense model. transformers'
    `generate` fails on a MoE model whose config sets `output_router_logits=True` (its aux loss meets a one-token
    step with the whole attention mask), so every posttrain inference call passes this."""
    return {"output_router_logits": False} if hasattr(_text_config(config), "output_router_logits") else {}


class RouterRecorder:
    """Router logits of the model calls of one log-prob pass, each with its real-token mask. `forward_kwargs` go
    into each model call; `record(output, mask)` keeps what it returned. A plain object, not a dataclass: FSDP2
    rebuilds the dataclasses in a forward's arguments, and the caller must read what the model calls recorded."""

    forward_kwargs = {"output_router_logits": True}

    def __init__(self, spec: MoeSpec):
        self.spec = spec
        self.logits: list[tuple[torch.Tensor, ...]] = []
        self.masks: list[torch.Tensor] = []

    def record(self, output, mask: torch.Tensor) -> None:
        router_logits = getattr(output, "router_logits", None)
        if not router_logits:
            raise RuntimeError("the model returned no router logits with output_router_logits=True")
        self.logits.append(tuple(router_logits))
        self.masks.append(mask.reshape(-1).float())

    def _layers(self) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
        """Per layer, the router logits of every call stacked by rows; the flat mask of the same rows."""
        layers = tuple(torch.cat([call[i] for call in self.logits]) for i in range(len(self.logits[0])))
        return layers, torch.cat(self.masks)

    def aux_loss(self) -> torch.Tensor:
        """The model's load-balancing loss over the real tokens of every recorded call (differentiable)."""
        layers, mask = self._layers()
        return self.spec.loss_fn(layers, self.spec.num_experts, self.spec.top_k, mask.to(layers[0].device))

    @torch.no_grad()
    def load(self) -> torch.Tensor:
        """(layers, experts): each expert's share of the top-k assignments of real tokens, per MoE layer
        (1 / experts everywhere when balanced)."""
        layers, mask = self._layers()
        mask = mask.to(layers[0].device).float()
        shares = []
        for layer in layers:
            chosen = torch.topk(layer.float(), self.spec.top_k, dim=-1).indices  # top-k of logits = of softmax
            counts = torch.zeros(self.spec.num_experts, device=layer.device)
            counts.scatter_add_(0, chosen.reshape(-1), mask.repeat_interleave(self.spec.top_k))
            shares.append(counts / counts.sum().clamp(min=1.0))
        return torch.stack(shares)

    def metrics(self, aux_loss: torch.Tensor) -> dict[str, float]:
        """Load imbalance = the busiest expert's share over the mean share (1 = perfectly balanced, `experts` =
        every token to one expert), the mean over MoE layers and that of the worst layer; and the aux loss value."""
        imbalance = self.load().max(dim=-1).values * self.spec.num_experts
        return {"moe/load_imbalance": float(imbalance.mean()), "moe/load_imbalance_worst_layer": float(imbalance.max()),
                "moe/aux_loss": float(aux_loss.detach())}
