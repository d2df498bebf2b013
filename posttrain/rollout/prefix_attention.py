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
`decode_state.DecodeState`, or a `paged_state.PagedDecodeState` (a server's), whose working copy of its blocks has
the same layout.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface

from .decode_state import DecodeState
from .prefix_buckets import bucketed_attention, gather_rows, grouped, scatter_rows, ungrouped

ATTENTION_NAME = "posttrain_shared_prefix"


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
    q_grouped = grouped(scatter_rows(q, state.rows, total), prompts, state.group)
    shared = torch.matmul(q_grouped, prefix_k.transpose(-1, -2))  # (prompts, kv, group * g, P)
    shared = gather_rows(ungrouped(shared, state.group), state.rows)  # (rows, kv, g, P)
    # one op: scale, mask and the float32 upcast (the bias is float32)
    scores = torch.add(state.bias, torch.cat([shared, own.view(rows, kv_heads, g, width)], dim=-1), alpha=scale)
    probs = torch.softmax(scores, dim=-1).to(value.dtype)
    p_grouped = grouped(scatter_rows(probs[..., :plen], state.rows, total), prompts, state.group)
    out = gather_rows(ungrouped(torch.matmul(p_grouped, prefix_v), state.group), state.rows)
    own_out = torch.bmm(probs[..., plen:].reshape(rows * kv_heads, g, width), value.view(rows * kv_heads, width, -1))
    out = out + own_out.view(rows, kv_heads, g, -1)
    return out.reshape(rows, 1, heads, value.shape[-1]), None


AttentionInterface.register(ATTENTION_NAME, shared_prefix_attention)

