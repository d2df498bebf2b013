"""MoE router replay (verl's `router_replay.mode` R2 / R3): the experts each token was routed to, recorded in one
forward and forced in another, so that the importance ratio pi / pi_old compares the same sub-network.

A routing record is kept per row and *position* — a token's position id, its index among the row's real tokens
(prompt, response, and a multi-turn response's appended tokens) — not per column: every forward here computes
positions as `cumsum(attention_mask) - 1`, so a record made in one layout (the engine's prefill and decoding steps,
a padded or a packed log-prob pass) replays in any other. Each model call's tokens are matched to (row, position)
by a hook on the decoder that reads the call's `position_ids` and its `attention_mask` (padded rows) or `packed`
bounds (packed rows); a call that shares prompts between rows (shared_prompt.py) is refused, so the passes that
record or replay run one model call per micro-batch, which also makes a layer recomputed in the backward pass
(activation checkpointing) see the same targets as in its forward.

A router is a transformers MoE gate returning (router_logits, routing_weights, selected_experts) with `top_k`,
`num_experts` and `norm_topk_prob` (Qwen2-MoE, Qwen3-MoE in transformers 5). Forcing it is the router's own
computation with its top-k replaced by the recorded experts (verl's: `scores.gather(1, replayed indices)`):
weights = softmax(router_logits) at those experts, renormalised when `norm_topk_prob`, so the router's weights get
the gradient of the weights of the experts the token is sent to. A token without a record (padding, the last sampled
token, which no forward fed back) or with a record that names an expert twice keeps the router's own choice. The
router logits the model returns (its load-balancing loss) are unchanged.
"""

from __future__ import annotations

import contextlib
from collections import deque

import torch
from torch import Tensor, nn

UNKNOWN = -1  # a position without a record
MODES = ("disabled", "R2", "R3")


def _base(model: nn.Module) -> nn.Module:
    from ..parallel.shard import base_model

    return base_model(model)


def routers(model: nn.Module) -> list[nn.Module]:
    """The model's MoE routers in layer order (empty for a dense model)."""
    return [m for m in _base(model).modules()
            if isinstance(m, nn.Module) and all(hasattr(m, a) for a in ("top_k", "num_experts", "weight"))
            and type(m).__name__.endswith("Router")]


def routing_shape(model: nn.Module) -> tuple[int, int]:
    """(MoE layers, experts per token) of a model whose routers replay; ValueError for one that has none."""
    found = routers(model)
    if not found:
        raise ValueError(f"router replay: {type(_base(model)).__name__} has no MoE router posttrain can replay (a "
                         "transformers MoE gate returning logits, weights and experts, such as Qwen2-MoE's or "
                         "Qwen3-MoE's)")
    return len(found), int(found[0].top_k)


class RoutingSession:
    """Hooks on one model for the duration of a `with` block: `record` fills `table` (rows, width, layers, k) with
    each router's choice at every (row, position) a call computes; `replay` forces `targets` (rows, width, layers,
    k), counting how often the router's own choice differed. `calls`: for each coming model call, the caller's row
    of each of the call's rows (default: the call's rows are the caller's rows 0, 1, ...)."""

    def __init__(self, model: nn.Module, *, record_width: int | None = None, rows: int | None = None,
                 targets: Tensor | None = None):
        from .logprobs import _decoder

        self.routers = routers(model)
        self.layers, self.k = len(self.routers), (int(self.routers[0].top_k) if self.routers else 0)
        self.targets = targets
        self.table = (torch.full((rows, record_width, self.layers, self.k), UNKNOWN, dtype=torch.long)
                      if record_width is not None else None)
        self.calls: deque = deque()
        self.compared = self.mismatched = 0  # (token, layer) pairs with a record, and those the router chose otherwise
        self._keys: tuple[Tensor, Tensor, Tensor] | None = None
        self._seen: set[int] = set()  # layers already counted in this call (a recomputed layer fires again)
        self._decoder = _decoder(_base(model))
        self._paused = False

    def __enter__(self) -> "RoutingSession":
        self._handles = [self._decoder.register_forward_pre_hook(self._on_call, with_kwargs=True)]
        self._handles += [r.register_forward_hook(self._hook(i)) for i, r in enumerate(self.routers)]
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()

    @contextlib.contextmanager
    def paused(self):
        """Model calls inside are not this session's (a one-time check's)."""
        self._paused = True
        try:
            yield
        finally:
            self._paused = False

    def _on_call(self, module, args, kwargs):
        """The (row, position, real) of each of the call's tokens, in the order the routers see them."""
        if self._paused:
            return
        if kwargs.get("shared_prompt") is not None:
            raise RuntimeError("router replay needs one model call per micro-batch: prompts must not be shared")
        ids = kwargs.get("input_ids", args[0] if args else None)
        mask, positions, packed = kwargs.get("attention_mask"), kwargs.get("position_ids"), kwargs.get("packed")
        if ids is None:
            raise RuntimeError("router replay: a model call without input_ids")
        if positions is None:
            positions = ((mask.long().cumsum(-1) - 1).clamp(min=0) if mask is not None and mask.dim() == 2
                         else torch.arange(ids.shape[1], device=ids.device).expand_as(ids))
        if positions.dim() != ids.dim():
            raise ValueError("router replay: the model computes positions per vision axis (a vision-language "
                             "model); router replay runs on text models")
        device = ids.device
        if packed is not None:  # one (1, N) row holding the rows' real tokens back to back
            lengths = torch.tensor([e - s for s, e in zip(packed.bounds[:-1], packed.bounds[1:])], device=device)
            rows = torch.repeat_interleave(torch.arange(len(lengths), device=device), lengths)
            real = torch.ones_like(rows, dtype=torch.bool)
        else:
            rows = torch.arange(ids.shape[0], device=device).repeat_interleave(ids.shape[1])
            real = (mask.bool().flatten() if mask is not None and mask.dim() == 2
                    else torch.ones_like(rows, dtype=torch.bool))
        if self.calls:
            rows = self.calls.popleft().to(device)[rows]
        self._keys = (rows, positions.flatten().to(device), real)
        self._seen = set()

    def _hook(self, layer: int):
        def hook(module, args, output):
            return self._route(layer, module, output)
        return hook

    def _route(self, layer: int, module: nn.Module, output):
        if self._paused:
            return None
        logits, weights, chosen = output
        rows, positions, real = self._keys
        if chosen.shape[0] != rows.numel():
            raise RuntimeError(f"router replay: layer {layer}'s router saw {chosen.shape[0]} tokens, the call has "
                               f"{rows.numel()}")
        if self.table is not None:  # record (no gradient flows here: the passes that record take none)
            keep = real & (positions < self.table.shape[1])
            self.table[rows[keep].cpu(), positions[keep].cpu(), layer] = chosen[keep].long().cpu()
            return None
        if self.targets is None:
            return None
        width = self.targets.shape[1]
        inside = real & (positions < width) & (rows < self.targets.shape[0])
        target = torch.full_like(chosen, UNKNOWN, dtype=torch.long)
        target[inside] = self.targets[rows[inside].cpu(), positions[inside].cpu(), layer].to(chosen.device)
        ordered = target.sort(-1).values
        known = (target >= 0).all(-1) & ~(ordered[:, 1:] == ordered[:, :-1]).any(-1)
        forced = torch.where(known[:, None], target, chosen.long())
        if layer not in self._seen:  # once per call: a layer recomputed in the backward pass fires again
            self._seen.add(layer)
            differs = (forced.sort(-1).values != chosen.long().sort(-1).values).any(-1) & known
            self.compared += int(known.sum())
            self.mismatched += int(differs.sum())
        probs = torch.softmax(logits.float(), dim=-1)
        forced_weights = probs.gather(-1, forced)
        if getattr(module, "norm_topk_prob", False):
            forced_weights = forced_weights / forced_weights.sum(-1, keepdim=True)
        return logits, forced_weights.to(weights.dtype), forced.to(chosen.dtype)

    def per_row(self, lengths: list[int]) -> list[Tensor]:
        """The record of each row, its first `lengths[i]` positions: (positions, layers, k) int16."""
        return [self.table[i, :n].to(torch.int16).clone() for i, n in enumerate(lengths)]


def targets_of(records: list[Tensor | None], width: int | None = None) -> Tensor:
    """Rows' records (positions, layers, k) — None for a row without one — as one (rows, width, layers, k) int64
    tensor, UNKNOWN where a row has no record."""
    have = [r for r in records if r is not None]
    if not have:
        raise ValueError("router replay: no row has a routing record")
    layers, k = have[0].shape[1:]
    width = max((r.shape[0] for r in have), default=0) if width is None else width
    out = torch.full((len(records), width, layers, k), UNKNOWN, dtype=torch.long)
    for i, r in enumerate(records):
        if r is not None:
            n = min(r.shape[0], width)
            out[i, :n] = r[:n].long()
    return out


@contextlib.contextmanager
def no_session():
    yield None
