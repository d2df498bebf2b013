"""Prefill: the keys and values of tokens that decoding starts from, computed by the model's ordinary forward.

Two cases: prompts (`prefill`), in buckets of similar length, not all padded to the longest (padding to the batch's
longest prompt is ~40% of a GSM8K batch's positions); and tokens appended to one sequence whose keys and values
are already computed (`prefill_after`: a tool's output returned into a multi-turn episode), where only the
appended tokens are computed.
"""

from __future__ import annotations

import torch

from ..models.shared_prompt import leading_padding

MAX_PREFILL_BUCKETS = 4  # prompts sorted by length are prefilled in up to this many calls ...
PREFILL_CALL_COST = 256  # ... each call counted as this many positions (its dispatch cost on small models)


def prefill_buckets(lengths: torch.Tensor, call_cost: int | None = None) -> list[torch.Tensor]:
    """Prompt indices sorted by length, split into 1 to `MAX_PREFILL_BUCKETS` buckets of equal count: the split with
    the fewest padded positions, each call counted as `call_cost` (default `PREFILL_CALL_COST`) more (16 GSM8K
    prompts: 2 buckets)."""
    call_cost = PREFILL_CALL_COST if call_cost is None else call_cost
    order = torch.argsort(lengths, stable=True)
    best_cost, best = None, [torch.arange(len(lengths))]  # one bucket: the prompts in their own order
    for count in range(1, min(MAX_PREFILL_BUCKETS, len(order)) + 1):
        parts = order.tensor_split(count)
        cost = sum(len(p) * int(lengths[p].max()) for p in parts) + call_cost * count
        if best_cost is None or cost < best_cost:
            best_cost, best = cost, (parts if count > 1 else best)
    return best


def _call(forward, config, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, cache=None):
    """One forward: the last position's logits (rows, V) and the transformers cache it filled."""
    from transformers import DynamicCache

    cache = DynamicCache(config=config) if cache is None else cache
    out = forward(input_ids=ids, attention_mask=mask, position_ids=positions, cache=cache, use_cache=True,
                  logits_to_keep=1)
    return out.logits[:, -1], cache


def prefill(forward, config, prompts: torch.Tensor, mask: torch.Tensor, call_cost: int | None = None):
    """Last-position logits (prompts, V) and per layer the prompts' keys and values (prompts, kv_heads, P,
    head_dim), P the batch's width, zeros on padding. `forward(cache=..., **inputs)` is the model's forward."""
    buckets = prefill_buckets(mask.sum(-1), call_cost)
    if len(buckets) == 1:  # the call's own cache is the prefix (no copy)
        logits, cache = _call(forward, config, prompts, mask, (mask.cumsum(-1) - 1).clamp(min=0))
        return logits, [layer.keys for layer in cache.layers], [layer.values for layer in cache.layers]
    width = prompts.shape[1]
    logits, keys, values = None, [], []
    for rows in buckets:
        start = leading_padding(mask[rows])
        part_mask = mask[rows, start:]
        part_logits, cache = _call(forward, config, prompts[rows, start:], part_mask,
                                   (part_mask.cumsum(-1) - 1).clamp(min=0))
        if logits is None:
            logits = part_logits.new_empty(len(prompts), part_logits.shape[-1])
            for layer in cache.layers:
                keys.append(layer.keys.new_zeros(len(prompts), layer.keys.shape[1], width, layer.keys.shape[3]))
                values.append(layer.values.new_zeros(len(prompts), layer.values.shape[1], width,
                                                     layer.values.shape[3]))
        logits[rows] = part_logits
        for layer, k, v in zip(cache.layers, keys, values):
            k[rows, :, start:] = layer.keys
            v[rows, :, start:] = layer.values
    return logits, keys, values


def prefill_after(forward, config, keys: list[torch.Tensor], values: list[torch.Tensor], tokens: torch.Tensor):
    """Tokens (1, T) appended to one sequence whose per-layer keys and values (1, kv_heads, L, head_dim) are given:
    the last appended token's logits (1, V) and the sequence's keys and values now (1, kv_heads, L + T,
    head_dim). Only the T appended positions are computed."""
    from transformers import DynamicCache

    cache = DynamicCache(config=config)
    for layer, (k, v) in enumerate(zip(keys, values)):
        cache.update(k, v, layer)
    past, new = keys[0].shape[2], tokens.shape[1]
    mask = torch.ones(1, past + new, dtype=torch.long, device=tokens.device)
    positions = torch.arange(past, past + new, device=tokens.device)[None]
    logits, cache = _call(forward, config, tokens, mask, positions, cache)
    return logits, [layer.keys for layer in cache.layers], [layer.values for layer in cache.layers]
