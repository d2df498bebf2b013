"""Decoding attention for `n` samples of one prompt: the prompt's keys and values are computed and read once.

An RL step samples `n` responses per prompt. Generating them as `n` independent rows computes the prompt `n`
times in the prefill and reads `n` copies of its keys and values at every decoded token. Here the prompt's keys
and values (the *prefix*, one row per prompt) are computed once; each sample row keeps only its own generated
tokens (the *suffix*). At a decoding step the queries of a prompt's `n` rows attend to the prefix in one matrix
product per prompt and to their own suffix, and one softmax over both parts gives exactly the attention of an
ordinary row — the same arithmetic as transformers' eager attention (products in the model's dtype, softmax in
float32).

The function is registered under `ATTENTION_NAME` in transformers' attention registry, so the model's own
modules (projections, rotary embeddings, norms, MLPs) run unchanged; it is switched on for decoding steps only.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface

ATTENTION_NAME = "posttrain_shared_prefix"
FIRST_CAPACITY = 16  # suffix positions at first; the buffers grow by a quarter when full
STATIC_FIRST_CAPACITY = 256  # the same in static mode (CUDA graphs): doubling from here, each size recorded once


class SharedPrefixCache:
    """The key/value cache of one decoding loop, passed to the model both as its cache and to the attention.

    Prefix: per layer (prompts, kv_heads, P, head_dim), from the prefill; `prefix_bias` (current rows, 1, 1, P)
    float32 is 0 on prompt tokens and -inf on left padding. Suffix: per layer (rows, kv_heads, capacity,
    head_dim), zero-filled, one position written per step; attention runs over the whole buffer with
    `bias` masking the unwritten positions (slicing it would make every product copy its operand), and the
    capacity (16 at first) grows by a quarter when full. `rows`: each current row's index among the prompts x
    group rows, None while no row has been dropped (`keep`)."""

    def __init__(self, keys: list[torch.Tensor], values: list[torch.Tensor], prefix_mask: torch.Tensor, group: int,
                 max_new: int, *, static: bool = False):
        self.prefix_keys, self.prefix_values, self.group, self.max_new = keys, values, group, max_new
        self.static = static
        bias = torch.zeros(prefix_mask.shape, dtype=torch.float32, device=prefix_mask.device)
        self.prefix_bias = bias.masked_fill(prefix_mask == 0, float("-inf")).repeat_interleave(group, 0)[:, None, None]
        self.rows: torch.Tensor | None = None
        self.length, self.capacity = 0, min(max_new, STATIC_FIRST_CAPACITY if static else FIRST_CAPACITY)
        self.keys: list[torch.Tensor | None] = [None] * len(keys)
        self.values: list[torch.Tensor | None] = [None] * len(keys)
        self.position = torch.tensor([0], device=prefix_mask.device)
        self._step_bias()

    def _step_bias(self) -> None:
        """`bias` (rows, 1, 1, P + capacity): the prompt's padding and the suffix positions not written yet at
        -inf, the same for every layer of a step; `position`: where this step's key and value go."""
        device = self.prefix_bias.device
        if self.static:
            self.position.fill_(self.length)  # in place: a recorded step reads this very tensor
        else:
            self.position = torch.tensor([self.length], device=device)
        unwritten = torch.arange(self.capacity, device=device) > self.length
        suffix = torch.zeros(self.capacity, device=device).masked_fill(unwritten, float("-inf"))
        self.bias = torch.cat([self.prefix_bias, suffix.expand(*self.prefix_bias.shape[:3], -1)], dim=-1)

    def reserve(self) -> None:
        """Static mode: every layer's buffers at the current capacity before the step (a recorded step cannot
        allocate them)."""
        for i, (pk, pv) in enumerate(zip(self.prefix_keys, self.prefix_values)):
            k = self.keys[i]
            if k is None or k.shape[2] < self.capacity:
                rows = len(self.prefix_bias)
                self.keys[i] = self._grown(pk.new_empty(rows, pk.shape[1], 0, pk.shape[3]), k)
                self.values[i] = self._grown(pv.new_empty(rows, pv.shape[1], 0, pv.shape[3]), self.values[i])

    def update(self, key_states, value_states, layer_idx, cache_kwargs=None, kwargs=None):
        """Write the current token's key and value; return the suffix buffers. (transformers passes the layer's
        extra arguments as `cache_kwargs` up to 5.23, as `kwargs` from 5.24; neither matters here.)"""
        k, v = self.keys[layer_idx], self.values[layer_idx]
        if k is None or k.shape[2] < self.capacity:
            k, v = self._grown(key_states, k), self._grown(value_states, v)
            self.keys[layer_idx], self.values[layer_idx] = k, v
        k.index_copy_(2, self.position, key_states[:, :, -1:])  # a tensor index: no recompiling per position
        v.index_copy_(2, self.position, value_states[:, :, -1:])
        return k, v

    def _grown(self, states: torch.Tensor, old: torch.Tensor | None) -> torch.Tensor:
        rows, heads, _, dim = states.shape
        new = states.new_empty(rows, heads, self.capacity, dim)
        kept = 0 if old is None else old.shape[2]
        if old is not None:
            new[:, :, :kept] = old
        new[:, :, kept:] = 0  # masked positions still enter the products: keep them finite
        return new

    def advance(self) -> None:
        """The current token is written in every layer: the next step writes the next position. The capacity grows
        by a quarter when full (static mode: doubles, so that few steps are recorded)."""
        self.length += 1
        if self.length == self.capacity and self.capacity < self.max_new:
            grown = 2 * self.capacity if self.static else self.capacity + self.capacity // 4
            self.capacity = min(self.max_new, grown)
        elif self.static:  # the same tensors, one more position unmasked
            self.position.fill_(self.length)
            self.bias[..., self.bias.shape[-1] - self.capacity + self.length] = 0.0
            return
        self._step_bias()

    def keep(self, keep: torch.Tensor) -> None:
        """Continue with the current rows `keep` only."""
        rows = torch.arange(len(self.prefix_bias), device=keep.device) if self.rows is None else self.rows
        self.rows, self.prefix_bias, self.bias = rows[keep], self.prefix_bias[keep], self.bias[keep]
        self.keys = [None if k is None else k.index_select(0, keep) for k in self.keys]
        self.values = [None if v is None else v.index_select(0, keep) for v in self.values]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.prefix_keys[0].shape[2] + self.length

    def __len__(self) -> int:
        return len(self.keys)


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
                            shared_prefix: SharedPrefixCache | None = None, sliding_window=None, softcap=None,
                            **kwargs):
    """query (rows, heads, 1, d); key / value: the suffix buffers (rows, kv_heads, capacity, d).
    Returns (rows, 1, heads, d), as transformers' attention functions do."""
    if (shared_prefix is None or query.shape[2] != 1 or softcap is not None or sliding_window is not None
            or kwargs.get("s_aux") is not None):
        raise RuntimeError("shared-prefix attention runs decoding steps of full attention only (one query token; "
                           "no sliding window, softcap or sinks)")
    cache = shared_prefix
    rows, heads, _, dim = query.shape
    kv_heads, width = key.shape[1], key.shape[2]
    g = heads // kv_heads
    scale = dim ** -0.5 if scaling is None else scaling
    prefix_k, prefix_v = cache.prefix_keys[module.layer_idx], cache.prefix_values[module.layer_idx]
    prompts, plen = prefix_k.shape[0], prefix_k.shape[2]
    total = prompts * cache.group

    q = query.view(rows, kv_heads, g, dim)
    own = torch.bmm(q.reshape(rows * kv_heads, g, dim), key.view(rows * kv_heads, width, dim).transpose(1, 2))
    q_grouped = _grouped(_scatter_rows(q, cache.rows, total), prompts, cache.group)
    shared = torch.matmul(q_grouped, prefix_k.transpose(-1, -2))  # (prompts, kv, group * g, P)
    shared = _gather_rows(_ungrouped(shared, cache.group), cache.rows)  # (rows, kv, g, P)
    # one op: scale, mask and the float32 upcast (the bias is float32)
    scores = torch.add(cache.bias, torch.cat([shared, own.view(rows, kv_heads, g, width)], dim=-1), alpha=scale)
    probs = torch.softmax(scores, dim=-1).to(value.dtype)
    p_grouped = _grouped(_scatter_rows(probs[..., :plen], cache.rows, total), prompts, cache.group)
    out = _gather_rows(_ungrouped(torch.matmul(p_grouped, prefix_v), cache.group), cache.rows)
    own_out = torch.bmm(probs[..., plen:].reshape(rows * kv_heads, g, width), value.view(rows * kv_heads, width, -1))
    out = out + own_out.view(rows, kv_heads, g, -1)
    return out.reshape(rows, 1, heads, value.shape[-1]), None


AttentionInterface.register(ATTENTION_NAME, shared_prefix_attention)

