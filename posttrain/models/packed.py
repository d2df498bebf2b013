"""Padding-free forwards: a micro-batch's rows run as one row of their real tokens, each attending only to itself.

Why: a padded forward computes `rows x (longest prompt + longest response)` positions; a long-tail length mix
(four rows of 4,000 tokens, sixty of 250) spends most of that on padding. Packed, the forward computes the real
tokens only, so a token budget (`use_dynamic_bsz`) bounds the memory a micro-batch really takes.

The rows' real tokens are concatenated into a (1, N) row; each token keeps the position the padded forward gives
it (`cumsum(attention_mask) - 1`), and attention is causal inside each row and blind across rows. The model's own
modules run; only the attention function differs (`attention` below, reached through the registered
`shared_prompt.ATTENTION_NAME` function when a call passes `packed=`), and the mask builder builds no mask for a
packed call (`mask_off`). The kernels (benchmarks/logprobs.py, docs/performance.md):

- CPU, and any device in float32: sdpa per row (`is_causal`), which computes only each row's own triangle;
- CUDA in bf16 / fp16: `torch.nn.attention.varlen.varlen_attn` (Flash attention over cumulative row offsets).
"""

from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass

import torch
import torch.nn.functional as F

_PACKED_CALL = contextvars.ContextVar("posttrain_packed_call", default=False)


@dataclass
class Packing:
    """Where each row lies in the packed row: `starts` (rows + 1,) cumulative offsets (int32, on the device),
    `bounds` the same as Python ints, `longest` the longest row; `sequence_group`: the process group this rank
    holds a share of the row for (Ulysses sequence parallel, models/ulysses.py), or None."""

    starts: torch.Tensor
    bounds: list[int]
    longest: int
    sequence_group: object = None


@dataclass
class Packed:
    """One micro-batch packed: `input_ids` and `position_ids` (1, N), `packing`, and `index` (B, T): the packed
    position of each real token of the padded layout, -1 on padding."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    packing: Packing
    index: torch.Tensor


def pack(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> Packed:
    """The real tokens of (B, T) rows (any padding, left or right) as one (1, N) row, with the padded forward's
    positions."""
    real = attention_mask.bool()
    lengths = real.sum(-1)
    bounds = [0] + lengths.cumsum(0).tolist()
    positions = (attention_mask.long().cumsum(-1) - 1)[real]
    index = torch.full(input_ids.shape, -1, dtype=torch.long, device=input_ids.device)
    index[real] = torch.arange(bounds[-1], device=input_ids.device)
    packing = Packing(starts=torch.tensor(bounds, dtype=torch.int32, device=input_ids.device), bounds=bounds,
                      longest=int(lengths.max()) if len(lengths) else 0)
    return Packed(input_ids=input_ids[real][None], position_ids=positions[None], packing=packing, index=index)


def predictors(packed: Packed, response_length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(valid (B, L) bool, packed positions (valid.sum(),)) of the hidden states that predict the last
    `response_length` columns' real tokens: the real token before each one (the position before it in the padded
    layout, as the response follows its prompt without a gap)."""
    index = packed.index[:, -int(response_length):]
    valid = index >= 0
    return valid, index[valid] - 1


@contextlib.contextmanager
def mask_off():
    """Around a packed model call: the mask builder returns no mask (the packed attention needs none; an
    (N, N) one would cost N^2 memory). The builder runs once per call, before the layers, so a layer recomputed in
    the backward pass does not need it."""
    token = _PACKED_CALL.set(True)
    try:
        yield
    finally:
        _PACKED_CALL.reset(token)


def in_packed_call() -> bool:
    return _PACKED_CALL.get()


def uses_varlen(query: torch.Tensor, dropout: float) -> bool:
    """Flash's varlen kernel: CUDA, half precision, no attention dropout."""
    return query.is_cuda and query.dtype in (torch.float16, torch.bfloat16) and not dropout


def attention(module, query, key, value, packing: Packing, *, dropout: float = 0.0, scaling=None):
    """Causal attention inside each packed row. `query` (1, H, N, D), `key` / `value` (1, Hk, N, D) as
    transformers' attention functions get them; returns (1, N, H, D)."""
    if uses_varlen(query, dropout):
        from torch.nn.attention.varlen import varlen_attn

        out = varlen_attn(query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1),
                          packing.starts, packing.starts, packing.longest, packing.longest, scale=scaling,
                          window_size=(-1, 0), enable_gqa=key.shape[1] != query.shape[1])
        return out[None], None
    gqa = key.shape[1] != query.shape[1]
    pieces = [F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True, scale=scaling, enable_gqa=gqa)
              for q, k, v in zip(*(rows_of(x, packing) for x in (query, key, value))) if q.shape[2]]
    return torch.cat(pieces, dim=2).transpose(1, 2).contiguous(), None


def rows_of(x: torch.Tensor, packing: Packing) -> tuple[torch.Tensor, ...]:
    """Each packed row's part of `x` (1, heads, N, D), by one `split`: its backward pass concatenates the rows'
    gradients once. Slicing row by row would cost each row's backward a zero-filled (1, heads, N, D) gradient, summed
    over the rows: quadratic in the rows (seconds per layer for 128 rows of 64 tokens)."""
    return x.split([e - s for s, e in zip(packing.bounds[:-1], packing.bounds[1:])], dim=2)


def right_padded(input_ids: torch.Tensor, attention_mask: torch.Tensor, pad: int = 0):
    """Rows with their real tokens moved to the front (right padding), as a reward model reads them."""
    real = attention_mask.bool()
    order = torch.sort((~real).int(), dim=-1, stable=True).indices
    ids, mask = input_ids.gather(-1, order), attention_mask.gather(-1, order)
    return torch.where(mask.bool(), ids, torch.full_like(ids, pad)), mask


def attention_after_prompt(query, key, value, prompt_key, prompt_value, prompts: Packing, rows: Packing,
                           row_prompt: list[int], *, dropout: float = 0.0, scaling=None, grouped_heads: bool = True):
    """Packed responses that each read their prompt's keys and values (a packed prompt call's, shared_prompt.py)
    and their own, causally: sdpa per row over `prompt || own` keys under a lower-right causal mask. `query` (1, H,
    N, D), `key` / `value` (1, Hk, N, D), `prompt_key` / `prompt_value` (1, Hk, Np, D); returns (1, N, H, D)."""
    pieces = []
    prompt_keys, prompt_values = rows_of(prompt_key, prompts), rows_of(prompt_value, prompts)
    for row, (q, k, v) in enumerate(zip(*(rows_of(x, rows) for x in (query, key, value)))):
        if not q.shape[2]:
            continue
        keys = torch.cat([prompt_keys[row_prompt[row]], k], dim=2)
        values = torch.cat([prompt_values[row_prompt[row]], v], dim=2)
        groups = query.shape[1] // keys.shape[1]
        if groups > 1 and not grouped_heads:
            keys, values = keys.repeat_interleave(groups, dim=1), values.repeat_interleave(groups, dim=1)
        length, before = q.shape[2], keys.shape[2] - q.shape[2]
        mask = torch.ones(length, before + length, dtype=torch.bool, device=query.device).tril(diagonal=before)
        pieces.append(F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, dropout_p=dropout,
                                                     scale=scaling, enable_gqa=keys.shape[1] != query.shape[1]))
    return torch.cat(pieces, dim=2).transpose(1, 2).contiguous(), None
