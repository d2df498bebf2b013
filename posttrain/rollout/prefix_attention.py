"""Decoding attention for `n` samples of one prompt: the prompt's keys and values are computed and read once.

An RL step samples `n` responses per prompt. Generating them as `n` independent rows computes the prompt `n`
times in the prefill and reads `n` copies of its keys and values at every decoded token. Here the prompt's keys
and values (the *prefix*, one slot per prompt) are computed once; each sample row keeps only its own generated
tokens (the *suffix*). At a decoding step the queries of a prompt's `n` rows attend to the prefix in one matrix
product per prompt and to their own suffix, and one softmax over both parts gives exactly the attention of an
ordinary row — the same arithmetic as transformers' eager attention (products in the model's dtype, softmax in
float32).

The function is registered under `ATTENTION_NAME` in transformers' attention registry, so the model's own
modules (projections, rotary embeddings, norms, MLPs) run unchanged; it is switched on for decoding steps only.
What it reads (the prefix and suffix buffers, the mask, which row reads which prefix) is the decoding run's state,
`decode_state.DecodeState`; on a `paged_state.PagedDecodeState` (a server's) the same products run on the blocks
each step reads, gathered first (`paged_attention`).
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface

from .decode_state import DecodeState
from .prefix_buckets import bucketed_attention

ATTENTION_NAME = "posttrain_shared_prefix"


def _grouped(x: torch.Tensor, prompts: int, group: int) -> torch.Tensor:
    """(prompts * group, kv, g, d) -> (prompts, kv, group * g, d): the queries of one prompt's samples together."""
    _, kv, g, d = x.shape
    return x.view(prompts, group, kv, g, d).transpose(1, 2).reshape(prompts, kv, group * g, d)


def _ungrouped(x: torch.Tensor, group: int) -> torch.Tensor:
    """Inverse of `_grouped`."""
    prompts, kv, gg, d = x.shape
    g = gg // group
    return x.view(prompts, kv, group, g, d).transpose(1, 2).reshape(prompts * group, kv, g, d)


def _scatter_rows(x: torch.Tensor, rows: torch.Tensor | None, total: int) -> torch.Tensor:
    if rows is None:
        return x
    return x.new_zeros((total, *x.shape[1:])).index_copy_(0, rows, x)


def _gather_rows(x: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
    return x if rows is None else x.index_select(0, rows)


def shared_prefix_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                            shared_prefix: DecodeState | None = None, sliding_window=None, softcap=None,
                            **kwargs):
    """query (rows, heads, 1, d); key / value: the suffix buffers (rows, kv_heads, capacity, d).
    Returns (rows, 1, heads, d), as transformers' attention functions do."""
    if (shared_prefix is None or query.shape[2] != 1 or softcap is not None or sliding_window is not None
            or kwargs.get("s_aux") is not None):
        raise RuntimeError("shared-prefix attention runs decoding steps of full attention only (one query token; "
                           "no sliding window, softcap or sinks)")
    state = shared_prefix
    if getattr(state, "paged", False):
        return paged_attention(module.layer_idx, query, state, scaling)
    rows, heads, _, dim = query.shape
    kv_heads, width = key.shape[1], key.shape[2]
    g = heads // kv_heads
    scale = dim ** -0.5 if scaling is None else scaling
    prefix_k, prefix_v = state.prefix_keys[module.layer_idx], state.prefix_values[module.layer_idx]
    prompts, plen = prefix_k.shape[0], prefix_k.shape[2]
    total = prompts * state.group

    q = query.view(rows, kv_heads, g, dim)
    own = torch.bmm(q.reshape(rows * kv_heads, g, dim), key.view(rows * kv_heads, width, dim).transpose(1, 2))
    buckets = state.buckets()  # prompts of very different widths: each read only as wide as it is
    if buckets is not None:
        out = bucketed_attention(state, buckets, module.layer_idx, q, own.view(rows, kv_heads, g, width), value, scale)
        return out.reshape(rows, 1, heads, value.shape[-1]), None
    q_grouped = _grouped(_scatter_rows(q, state.rows, total), prompts, state.group)
    shared = torch.matmul(q_grouped, prefix_k.transpose(-1, -2))  # (prompts, kv, group * g, P)
    shared = _gather_rows(_ungrouped(shared, state.group), state.rows)  # (rows, kv, g, P)
    # one op: scale, mask and the float32 upcast (the bias is float32)
    scores = torch.add(state.bias, torch.cat([shared, own.view(rows, kv_heads, g, width)], dim=-1), alpha=scale)
    probs = torch.softmax(scores, dim=-1).to(value.dtype)
    p_grouped = _grouped(_scatter_rows(probs[..., :plen], state.rows, total), prompts, state.group)
    out = _gather_rows(_ungrouped(torch.matmul(p_grouped, prefix_v), state.group), state.rows)
    own_out = torch.bmm(probs[..., plen:].reshape(rows * kv_heads, g, width), value.view(rows * kv_heads, width, -1))
    out = out + own_out.view(rows, kv_heads, g, -1)
    return out.reshape(rows, 1, heads, value.shape[-1]), None


def _gathered(pool_tensor: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """The blocks `table` (n, blocks) names, in order, from a pool tensor (kv_heads, num_blocks, BLOCK, head_dim):
    (kv_heads, n, blocks * BLOCK, head_dim), one copy."""
    n, blocks = table.shape
    kv, _, block, dim = pool_tensor.shape
    return pool_tensor.index_select(1, table.flatten()).view(kv, n, blocks * block, dim)


def paged_attention(layer: int, query: torch.Tensor, state, scaling=None):
    """The same step on a paged state (paged_state.py), in kv-head-major order (a gather of blocks is then one
    contiguous copy): each slot's blocks gathered once for all its rows (its rows' queries side by side, one
    product), each row's own blocks gathered for it, one softmax over both. query (rows, heads, 1, d); returns
    (rows, 1, heads, d)."""
    rows, heads, _, dim = query.shape
    keys, values = state.pool.keys[layer], state.pool.values[layer]
    kv_heads = keys.shape[0]
    g = heads // kv_heads
    scale = dim ** -0.5 if scaling is None else scaling
    slots, group = state.slot_table.shape[0], state.group
    q = query.view(rows, kv_heads, g, dim).transpose(0, 1)  # (kv, rows, g, d)
    own_k, own_v = _gathered(keys, state.own_table), _gathered(values, state.own_table)
    scores = torch.matmul(q, own_k.transpose(-1, -2))  # (kv, rows, g, own columns)
    plen = state.slot_table.shape[1] * keys.shape[2]
    if plen:
        prefix_k, prefix_v = _gathered(keys, state.slot_table), _gathered(values, state.slot_table)
        q_slots = _scatter_rows(q.transpose(0, 1), state.rows, slots * group).transpose(0, 1)
        shared = torch.matmul(q_slots.reshape(kv_heads, slots, group * g, dim), prefix_k.transpose(-1, -2))
        shared = _gather_rows(shared.view(kv_heads, slots * group, g, plen).transpose(0, 1), state.rows)
        scores = torch.cat([shared.transpose(0, 1), scores], dim=-1)
    # one op: scale, mask and the float32 upcast (the bias is float32)
    scores = torch.add(state.bias.view(1, rows, 1, -1), scores, alpha=scale)
    probs = torch.softmax(scores, dim=-1).to(own_v.dtype)
    out = torch.matmul(probs[..., plen:], own_v)  # (kv, rows, g, d)
    if plen:
        p_slots = _scatter_rows(probs[..., :plen].transpose(0, 1), state.rows, slots * group).transpose(0, 1)
        shared = torch.matmul(p_slots.reshape(kv_heads, slots, group * g, plen), prefix_v)
        out = out + _gather_rows(shared.view(kv_heads, slots * group, g, dim).transpose(0, 1),
                                 state.rows).transpose(0, 1)
    return out.transpose(0, 1).reshape(rows, 1, heads, dim), None


AttentionInterface.register(ATTENTION_NAME, shared_prefix_attention)

