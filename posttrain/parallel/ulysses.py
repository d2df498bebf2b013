"""Ulysses sequence parallel: one packed row split along the sequence over the `sp` ranks of a sequence-parallel
group, each rank holding the same rows (actor_rollout_ref.actor.ulysses_sequence_parallel_size).

Why: a long sequence's activations (every layer's hidden states, kept for the backward pass) grow with its length;
split over `sp` ranks, each rank keeps 1/sp of them. Only attention needs the whole sequence: around it an
all-to-all turns (seq/sp, heads) into (seq, heads/sp), attention runs on the full packed row for a subset of the
heads, and the inverse all-to-all restores (seq/sp, heads). Everything else (embeddings, MLPs, norms, rotary
positions) is per token and runs on the rank's shard.

Each rank computes the log-probs (or values) of the response tokens its shard predicts; `sum_over_group` adds the
shards' (B, L) tensors, zero where another rank computed, so every rank of the group holds the whole result and
computes the same loss. Its backward passes the gradient through unchanged: each rank's weights then get the
gradient of its own tokens, and FSDP's sum over the group's ranks (it shards over data x sequence ranks) gives
the gradient of one process. gloo and NCCL both run `all_to_all_single` (checked on gloo, torch 2.11
and 2.13, CPU).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses

import torch
import torch.distributed as dist

_GROUP = contextvars.ContextVar("posttrain_sequence_group", default=None)


@contextlib.contextmanager
def sequence_parallel(group):
    """Packed forwards inside split their rows over `group` (a process group; None: no split)."""
    token = _GROUP.set(group if group is not None and dist.get_world_size(group) > 1 else None)
    try:
        yield
    finally:
        _GROUP.reset(token)


def active_group():
    return _GROUP.get()


def check_model(config, sp: int) -> None:
    """Refuse at load a model the sequence split cannot run: heads that do not divide over the ranks, attention
    that is not full (sliding windows). (A model that does not run packed rows — vision-language models — is
    refused at its first forward: roles/common.py.)"""
    if sp <= 1:
        return
    key = "actor_rollout_ref.actor.ulysses_sequence_parallel_size"
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    for name in ("num_attention_heads", "num_key_value_heads"):
        heads = getattr(text, name, None)
        if heads is not None and heads % sp:
            raise ValueError(f"{key}={sp}: {name}={heads} is not divisible by it (each rank attends with "
                             "heads / sp heads)")
    kinds = set(getattr(text, "layer_types", None) or ["full_attention"])
    if kinds != {"full_attention"}:
        raise ValueError(f"{key}={sp}: the model's layers are {', '.join(sorted(kinds))}; only full attention "
                         "is split")


def split(rows, group):
    """This rank's contiguous share of a packed row (models/packed.py's `Packed`): (input_ids, position_ids (1, N_pad / sp), the packing of the
    whole padded row with `sequence_group` set, the offset of the share). The row is padded to a multiple of sp
    with one extra padding row that attends only to itself."""
    sp, rank = dist.get_world_size(group), dist.get_rank(group)
    ids, positions, packing = rows.input_ids, rows.position_ids, rows.packing
    n = ids.shape[1]
    pad = -n % sp
    if pad:
        ids = torch.cat([ids, ids.new_zeros(1, pad)], dim=1)
        positions = torch.cat([positions, torch.arange(pad, device=ids.device)[None]], dim=1)
        bounds = packing.bounds + [n + pad]
        packing = type(packing)(starts=torch.tensor(bounds, dtype=torch.int32, device=ids.device), bounds=bounds,
                          longest=max(packing.longest, pad))
    packing = dataclasses.replace(packing, sequence_group=group)
    share = (n + pad) // sp
    start = rank * share
    return ids[:, start:start + share], positions[:, start:start + share], packing, start


def on_this_share(valid: torch.Tensor, at: torch.Tensor, start: int, length: int):
    """(the `valid` (B, L) positions predicted by this rank's share [start, start + length), their rows of the
    share's hidden states) from `valid` and the packed positions `at` of every valid one (packed.predictors)."""
    here = (at >= start) & (at < start + length)
    mine = valid.clone()
    mine[valid] = here
    return mine, at[here] - start


def _all_to_all(x: torch.Tensor, scatter_dim: int, gather_dim: int, group) -> torch.Tensor:
    """Chunk i of `x` along `scatter_dim` to rank i; the chunks received joined along `gather_dim`. One
    `all_to_all_single` over the chunks stacked: gloo runs it in every torch posttrain supports, its list form
    `all_to_all` only from 2.13 on."""
    chunks = torch.stack(x.chunk(dist.get_world_size(group), dim=scatter_dim))
    received = torch.empty_like(chunks)
    dist.all_to_all_single(received, chunks, group=group)
    return torch.cat(received.unbind(0), dim=gather_dim)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, scatter_dim: int, gather_dim: int, group):
        ctx.dims, ctx.group = (scatter_dim, gather_dim), group
        return _all_to_all(x, scatter_dim, gather_dim, group)

    @staticmethod
    def backward(ctx, grad):
        scatter_dim, gather_dim = ctx.dims
        return _all_to_all(grad, gather_dim, scatter_dim, ctx.group), None, None, None


def heads_to_sequence(x: torch.Tensor, group) -> torch.Tensor:
    """(1, H, N/sp, D) -> (1, H/sp, N, D): this rank's heads over the whole row."""
    return _AllToAll.apply(x, 1, 2, group)


def sequence_to_heads(x: torch.Tensor, group) -> torch.Tensor:
    """(1, N, H/sp, D) (an attention function's output) -> (1, N/sp, H, D): every head of this rank's share."""
    return _AllToAll.apply(x, 1, 2, group)


class _SumOverGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad, None  # every rank computes the same loss from the sum: its own share's gradient is `grad`


def sum_over_group(x: torch.Tensor, group, hidden: torch.Tensor) -> torch.Tensor:
    """The sum of the group's tensors (each zero where another rank computed); backward: the gradient unchanged.
    `hidden`, this rank's hidden states, joins the graph even where the share predicts no response token, so that
    every rank's backward pass runs the attention's all-to-alls, which the others wait for."""
    if not x.is_floating_point():
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out
    if hidden.requires_grad:
        x = x + hidden[:0].sum().to(x.dtype)
    return _SumOverGroup.apply(x, group)


def attention(attend, query, key, value, packing):
    """`attend(query, key, value)` (an attention over the whole packed row, returning (1, N, h, D)) on this rank's
    heads, from and back to its share of the sequence."""
    group = packing.sequence_group
    sp = dist.get_world_size(group)
    if query.shape[1] % sp or key.shape[1] % sp:
        raise ValueError(f"sequence parallel: {query.shape[1]} query / {key.shape[1]} key heads do not divide over "
                         f"{sp} ranks")
    out, weights = attend(heads_to_sequence(query, group), heads_to_sequence(key, group),
                          heads_to_sequence(value, group))
    return sequence_to_heads(out, group), weights
