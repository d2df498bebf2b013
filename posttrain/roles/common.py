"""What every role does with a batch: split it into micro-batches and compute response log-probs on them."""

from __future__ import annotations

import contextlib
import math

import torch

from ..data.batch import Batch
from ..models.load import autocast
from ..models.logprobs import response_logprobs


def micro_batches(batch: Batch, size: int | None, *, max_tokens: int | None = None) -> list[Batch]:
    """Split into micro-batches of `size` responses, or (with `max_tokens`) greedy packs of at most that many
    real tokens (a single longer response still gets its own micro-batch)."""
    if max_tokens:
        lengths = batch["attention_mask"].sum(-1).tolist()
        groups, current, used = [], [], 0
        for i, n in enumerate(lengths):
            if current and used + n > max_tokens:
                groups.append(current)
                current, used = [], 0
            current.append(i)
            used += n
        if current:
            groups.append(current)
        return [batch.select(g) for g in groups]
    return list(batch.chunks(size or len(batch)))


def trimmed(batch: Batch) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """input_ids / attention_mask without all-padding columns; returns the kept response width and the full one."""
    prompts_w = batch["prompts"].shape[1]
    full_l = batch["responses"].shape[1]
    mask = batch["attention_mask"]
    start = int((mask[:, :prompts_w].sum(0) > 0).nonzero().min()) if mask[:, :prompts_w].any() else prompts_w - 1
    resp_l = max(int(batch["response_mask"].sum(-1).max()), 1)
    end = prompts_w + resp_l
    return batch["input_ids"][:, start:end], mask[:, start:end], resp_l, full_l


def forward_logprobs(model, batch: Batch, *, device, dtype, temperature: float, with_entropy: bool,
                     chunk_size: int = 1024) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(B, L) log-probs (and entropy) of the response tokens of one micro-batch, padded back to full width."""
    ids, mask, resp_l, full_l = trimmed(batch)
    with autocast(device, dtype):
        logp, ent = response_logprobs(model, ids.to(device), mask.to(device), resp_l, temperature=temperature,
                                      chunk_size=chunk_size, with_entropy=with_entropy)
    pad = full_l - resp_l
    logp = torch.nn.functional.pad(logp.float(), (0, pad))
    ent = torch.nn.functional.pad(ent.float(), (0, pad)) if ent is not None else None
    return logp, ent


@contextlib.contextmanager
def eval_mode(model):
    """Dropout off for passes that must be deterministic (old/ref log-probs, values), the mode restored after;
    updates run in train mode, so a model with dropout trains with it, as its config asks."""
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)


@torch.no_grad()
def batch_logprobs(model, batch: Batch, *, micro_batch_size, max_tokens, device, dtype, temperature,
                   with_entropy=False) -> tuple[torch.Tensor, torch.Tensor | None]:
    logps, ents = [], []
    with eval_mode(model):
        for mb in micro_batches(batch, micro_batch_size, max_tokens=max_tokens):
            logp, ent = forward_logprobs(model, mb, device=device, dtype=dtype, temperature=temperature,
                                         with_entropy=with_entropy)
            logps.append(logp.cpu())
            ents.append(ent.cpu() if ent is not None else None)
    return torch.cat(logps), (torch.cat(ents) if with_entropy else None)


def lr_lambda(warmup_steps: int, total_steps: int, style: str, min_lr_ratio: float):
    """Linear warmup, then constant or cosine down to min_lr_ratio."""

    def fn(step: int) -> float:
        if warmup_steps > 0 and step < warmup_steps:
            return (step + 1) / warmup_steps
        if style == "cosine" and total_steps > warmup_steps:
            progress = min((step - warmup_steps) / max(total_steps - warmup_steps, 1), 1.0)
            return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
        return 1.0

    return fn


def make_optimizer(model, optim_cfg, total_steps: int):
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=optim_cfg.lr, betas=tuple(optim_cfg.betas), weight_decay=optim_cfg.weight_decay)
    total = optim_cfg.total_training_steps if optim_cfg.total_training_steps > 0 else total_steps
    warmup = optim_cfg.lr_warmup_steps if optim_cfg.lr_warmup_steps > 0 else int(optim_cfg.lr_warmup_steps_ratio * total)
    style = optim_cfg.warmup_style or optim_cfg.lr_scheduler_type
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(warmup, total, style, optim_cfg.min_lr_ratio))
    return opt, sched
