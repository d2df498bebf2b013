"""Prefill: the keys and values of tokens that decoding starts from, computed by the model's ordinary forward.

Two cases: prompts (`prefill`), in buckets of similar length, not all padded to the longest (padding to the batch's
longest prompt is ~40% of a GSM8K batch's positions); and tokens appended to one sequence whose keys and values
are already computed (`prefill_after`: tools' outputs returned into multi-turn episodes, several sequences in one
call), where only the appended tokens are computed.
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


def prefill_after(forward, config, pasts: list[tuple[list[torch.Tensor], list[torch.Tensor]]],
                  tokens: list[torch.Tensor]):
    """Tokens `tokens[i]` (T_i,) appended to sequence i, whose per-layer keys and values (1, kv_heads, L_i,
    head_dim) are `pasts[i]`: one forward computing only the appended positions. Returns the last appended token's
    logits (k, V), per layer the sequences' keys and values now (k, kv_heads, P + T, head_dim), and their mask
    (k, P + T): each row is its past left-padded to the longest past P, then its tokens left-padded to the longest
    T (padding holds zeros, masked; a row's real positions are its L_i + T_i tokens, in order)."""
    from transformers import DynamicCache

    pad = torch.nn.functional.pad
    device = tokens[0].device
    lengths = [k[0].shape[2] for k, _ in pasts]
    counts = [len(t) for t in tokens]
    P, T = max(lengths), max(counts)
    cache = DynamicCache(config=config)
    for layer in range(len(pasts[0][0])):
        keys = torch.cat([pad(k[layer], (0, 0, P - n, 0)) for (k, _), n in zip(pasts, lengths)])
        values = torch.cat([pad(v[layer], (0, 0, P - n, 0)) for (_, v), n in zip(pasts, lengths)])
        cache.update(keys, values, layer)
    ids = torch.stack([pad(t, (T - c, 0)) for t, c in zip(tokens, counts)])
    mask = torch.tensor([[0] * (P - n) + [1] * n + [0] * (T - c) + [1] * c for n, c in zip(lengths, counts)],
                        dtype=torch.long, device=device)
    positions = torch.stack([torch.arange(T, device=device) + n - (T - c) for n, c in zip(lengths, counts)])
    logits, cache = _call(forward, config, ids, mask, positions.clamp(min=0), cache)
    return logits, [layer.keys for layer in cache.layers], [layer.values for layer in cache.layers], mask
