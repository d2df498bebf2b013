"""Padding-free forwards: a micro-batch's rows run as one row of their real tokens, each attending only to itself.

Why: a padded forward computes `rows x (longest prompt + longest response)` positions; a long-tail length mix
(four rows of 4,000 tokens, sixty of 250) spends most of that on padding. Packed, the forward computes the real
tokens only, so a token budget (`use_dynamic_bsz`) bounds the memory a micro-batch really takes.

The rows' real tokens are concatenated into a (1, N) row; each token keeps the position the padded forward gives
it (`cumsum(attention_mask) - 1`), and attention is causal inside each row and blind across rows. The model's own
modules run; only the attention function differs (`attention` below, reached through the registered
`shared_prompt.ATTENTION_NAME` function when a call passes `packed=`), and the mask builder builds no mask for a
packed call (`mask_off`). The kernels (benchmarks/logprobs.py, docs/performance.md):

- CPU, and any device in float32: sdpa per row (`is_causal`), which computes only each row's own triangle; on a CPU
  bf16 inputs are computed in float32 (`sdpa`);
- CUDA in bf16 / fp16: `torch.nn.attention.varlen.varlen_attn` (Flash attention over cumulative row offsets),
  where the installed torch has it (2.10 and newer; its keywords differ between releases, `varlen_kernel`).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect
from dataclasses import dataclass, field

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
    cache: dict = field(default_factory=dict, repr=False, compare=False)  # what each layer of a call would redo


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
    """Flash's varlen kernel: CUDA, half precision, no attention dropout, and a torch that has it."""
    return (query.is_cuda and query.dtype in (torch.float16, torch.bfloat16) and not dropout
            and varlen_kernel() is not None)


@functools.cache
def varlen_kernel():
    """(torch's `varlen_attn`, the keywords it takes), or None before torch 2.10. The keywords moved between
    releases: 2.10 takes `is_causal` and no scale; 2.11 `scale` and `window_size`; 2.13 adds `enable_gqa`."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn, frozenset(inspect.signature(varlen_attn).parameters)


def _varlen_attention(query, key, value, packing: Packing, scaling) -> torch.Tensor:
    """`attention` through the varlen kernel, whichever keywords this torch's takes: (N, H, D)."""
    kernel, keywords = varlen_kernel()
    q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))
    options = {"window_size": (-1, 0)} if "window_size" in keywords else {"is_causal": True}
    if scaling is not None and "scale" in keywords:
        options["scale"] = scaling
    elif scaling is not None and abs(scaling * q.shape[-1] ** 0.5 - 1) > 1e-12:
        q = q * (scaling * q.shape[-1] ** 0.5)  # the kernel's own scale is 1 / sqrt(head dim)
    if k.shape[1] != q.shape[1]:
        if "enable_gqa" in keywords:
            options["enable_gqa"] = True
        else:
            k, v = (x.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for x in (k, v))
    return kernel(q, k, v, packing.starts, packing.starts, packing.longest, packing.longest, **options)


def sdpa(query, key, value, **options) -> torch.Tensor:
    """`F.scaled_dot_product_attention`; on a CPU, bf16 inputs are computed in float32 and the output cast back. Why:
    the CPU's bf16 flash kernel is the slow one, not the fast: forward and backward of one prompt's 8 responses
    (queries (8, 8, 64, 64), keys (8, 4, 150, 64)) take 2.5x the float32 kernel's time, and attention was a fifth of
    a bf16 GRPO step (docs/performance.md). The float32 result is also the more exact one. Under bf16 autocast the
    queries may be float32 (rotary embeddings) and autocast would lower the call to bf16: it is off around it, and
    the output is bf16 as autocast's would be."""
    lowered = torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16
    if query.device.type != "cpu" or not (query.dtype == torch.bfloat16 or lowered):
        return F.scaled_dot_product_attention(query, key, value, **options)
    with torch.autocast("cpu", enabled=False):
        out = F.scaled_dot_product_attention(query.float(), key.float(), value.float(), **options)
    return out.to(torch.bfloat16)


def attention(module, query, key, value, packing: Packing, *, dropout: float = 0.0, scaling=None):
    """Causal attention inside each packed row. `query` (1, H, N, D), `key` / `value` (1, Hk, N, D) as
    transformers' attention functions get them; returns (1, N, H, D)."""
    if uses_varlen(query, dropout):
        return _varlen_attention(query, key, value, packing, scaling)[None], None
    gqa = key.shape[1] != query.shape[1]
    pieces = [sdpa(q, k, v, dropout_p=dropout, is_causal=True, scale=scaling, enable_gqa=gqa)
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
    and their own, causally. `query` (1, H, N, D), `key` / `value` (1, Hk, N, D), `prompt_key` / `prompt_value`
    (1, Hk, Np, D); returns (1, N, H, D).

    One sdpa call per prompt, over all the rows that share it, right-padded to the longest of them: `prompt || own`
    keys under one lower-right causal mask. A row's real queries never reach its padded keys (they come after
    them), and the padded queries' outputs are dropped, so their gradient, and what it sends back, is exactly zero.
    Row by row, the calls were many and small (8 rows of 64 tokens a prompt: a backward pass 2.5x as long)."""
    layout = _sharer_layout(rows, row_prompt, query.device)
    if not layout.sizes:
        return query.new_zeros(1, 0, query.shape[1], query.shape[3]), None
    prompt_keys, prompt_values = rows_of(prompt_key, prompts), rows_of(prompt_value, prompts)
    heads, kv_heads, dim = query.shape[1], key.shape[1], query.shape[3]
    # one gather and one split each, so the backward pass scatters into the packed row once, not once per prompt
    # (none where the packed row is already the padded layout: rows of equal length, in prompt order)
    qs, ks, vs = ((x[0] if layout.padded is None else x[0].index_select(1, layout.padded)).split(layout.sizes, dim=1)
                  for x in (query, key, value))
    pieces = []
    for prompt, n, longest, q, k, v in zip(layout.prompts, layout.sharers, layout.longest, qs, ks, vs):
        q, k, v = (x.unflatten(1, (n, longest)).transpose(0, 1) for x in (q, k, v))
        keys = torch.cat([prompt_keys[prompt].expand(n, -1, -1, -1), k], dim=2)
        values = torch.cat([prompt_values[prompt].expand(n, -1, -1, -1), v], dim=2)
        if heads != kv_heads and not grouped_heads:
            keys = keys.repeat_interleave(heads // kv_heads, dim=1)
            values = values.repeat_interleave(heads // kv_heads, dim=1)
        before = keys.shape[2] - longest
        mask = torch.ones(longest, before + longest, dtype=torch.bool, device=query.device).tril(diagonal=before)
        out = sdpa(q, keys, values, attn_mask=mask, dropout_p=dropout, scale=scaling,
                                             enable_gqa=keys.shape[1] != heads)
        pieces.append(out.transpose(1, 2).reshape(n * longest, heads, dim))
    out = torch.cat(pieces)
    return (out if layout.padded is None else out.index_select(0, layout.packed))[None], None


@dataclass
class _SharerLayout:
    """The responses grouped by prompt, each group right-padded to its longest row: `prompts` the groups' prompt
    indices, `sharers` / `longest` their row counts and longest rows, `sizes` their padded token counts; `padded`
    (sum(sizes),) the packed token at each padded place (a padding place repeats its row's last token) and
    `packed` (N,) the padded place of each packed token; both None where the two layouts are one."""

    prompts: list[int]
    sharers: list[int]
    longest: list[int]
    sizes: list[int]
    padded: torch.Tensor | None
    packed: torch.Tensor | None


def _sharer_layout(rows: Packing, row_prompt: list[int], device) -> _SharerLayout:
    """`attention_after_prompt`'s layout, made once per packing (every layer of a call reads the same)."""
    cached = rows.cache.get("sharers")
    if cached is not None:
        return cached
    lengths = [e - s for s, e in zip(rows.bounds[:-1], rows.bounds[1:])]
    groups: dict[int, list[int]] = {}
    for row, prompt in enumerate(row_prompt):
        if lengths[row]:
            groups.setdefault(prompt, []).append(row)
    padded, packed = [], [0] * rows.bounds[-1]
    longest = [max(lengths[r] for r in members) for members in groups.values()]
    for members, width in zip(groups.values(), longest):
        for row in members:
            start, length = rows.bounds[row], lengths[row]
            packed[start:start + length] = range(len(padded), len(padded) + length)
            padded.extend(range(start, start + length))
            padded.extend([start + length - 1] * (width - length))
    same = padded == list(range(rows.bounds[-1]))
    layout = _SharerLayout(list(groups), [len(m) for m in groups.values()], longest,
                           [len(m) * w for m, w in zip(groups.values(), longest)],
                           None if same else torch.tensor(padded, device=device),
                           None if same else torch.tensor(packed, device=device))
    rows.cache["sharers"] = layout
    return layout
