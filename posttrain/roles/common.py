"""What every role does with a batch.

Every rank holds the whole (global) batch of a step; a role computes on its data-parallel share — whole prompt
groups, balanced by tokens — split into micro-batches whose count is the same on every rank, and gathers the
per-row results back into a (B, L) tensor. In one process the share is the whole batch and the gathers are no-ops.
"""

from __future__ import annotations

import contextlib
import math

import torch

from ..algo import group_ids
from ..data.batch import Batch
from ..models.load import attention_backends, autocast, eval_mode
from ..models.shared_prompt import leading_padding, prompt_groups
from ..models.vision import MM_KEY
from ..parallel import Parallel, balance, clip_grad_norm, is_sharded
from ..parallel.ulysses import sequence_parallel


def group_rows(uids) -> list[list[int]]:
    """Row indices of each prompt group, groups in order of first appearance."""
    groups: list[list[int]] = []
    for row, g in enumerate(group_ids(uids).tolist()):
        if g == len(groups):
            groups.append([])
        groups[g].append(row)
    return groups


def response_widths(attention: torch.Tensor) -> torch.Tensor:
    """(B,) each row's response width up to its last real token, from the response part of the attention mask
    (a multi-turn response's appended tokens count, also those after its last policy token)."""
    real = attention.bool()
    last = real.shape[-1] - real.flip(-1).int().argmax(-1)
    return torch.where(real.any(-1), last, torch.zeros_like(last))


def trimmed(batch: Batch) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """input_ids / attention_mask without all-padding columns; returns the kept response width and the full one."""
    prompts_w = batch["prompts"].shape[1]
    full_l = batch["responses"].shape[1]
    mask = batch["attention_mask"]
    start = leading_padding(mask[:, :prompts_w])
    resp_l = max(int(response_widths(mask[:, prompts_w:]).max()), 1)
    end = prompts_w + resp_l
    return batch["input_ids"][:, start:end], mask[:, start:end], resp_l, full_l


def padded_widths(batch: Batch) -> tuple[list[int], list[int]]:
    """Each row's prompt and response width as a forward pads them (`trimmed`): the prompt from its first real
    token (left padding), the response by its real tokens. Rows without prompts (the reward model's re-encoded,
    right-padded rows) are all response."""
    mask = batch["attention_mask"]
    if "prompts" not in batch:
        return [0] * len(mask), mask.sum(-1).tolist()
    prompts_w = batch["prompts"].shape[1]
    real = mask[:, :prompts_w].bool()
    first = torch.where(real.any(-1), real.int().argmax(-1), torch.full_like(real[:, 0], prompts_w, dtype=torch.long))
    return (prompts_w - first).tolist(), response_widths(mask[:, prompts_w:]).tolist()


def images_of(mb: Batch):
    """Each row's image inputs (vision-language rows, models/vision.py), or None for a text-only batch."""
    return mb.meta.get(MM_KEY)


def shared_prompts(mb: Batch):
    """The rows of a micro-batch that share a prompt (one prompt group = one uid), for the models' shared-prompt
    passes; None when the rows carry no uid."""
    return prompt_groups(mb.meta["uid"]) if "uid" in mb.meta else None


class ModelRunner:
    """Runs one role's model in this process: picks the rank's data-parallel share of a batch, splits it into
    micro-batches, runs the forward in the right precision, clips and takes the optimizer step."""

    def __init__(self, model, par: Parallel, *, dtype: torch.dtype, balance_batch: bool = True,
                 remove_padding: bool = False):
        self.model, self.par, self.dtype, self.balance_batch = model, par, dtype, balance_batch
        self.remove_padding = remove_padding
        self.sharded = is_sharded(model)

    def packs(self) -> bool:
        """Whether micro-batches run padding-free (`use_remove_padding`, models/packed.py): asked for, and the
        model passed its one-time check — run here, through the model's own forward on a two-token row, so that
        every rank of a sharded model makes the call at the same point (the micro-batch split needs the answer)."""
        if not callable(getattr(self.model, "packs", None)):
            return False
        if not self.remove_padding:
            self._check_split(False)
            return False  # a model without a packed path (the reward model decides for itself)
        if getattr(self.model, "packed_ok", None) is None:
            ids = torch.zeros((1, 2), dtype=torch.long, device=self.device)
            with torch.no_grad(), eval_mode(self.model), self.autocast():
                self.model(ids, torch.ones_like(ids), 1, packed=True)
        packs = bool(getattr(self.model, "packed_ok", False))
        self._check_split(packs)
        return packs

    def _check_split(self, packs: bool) -> None:
        """A trained model under sequence parallel must run packed rows, which are what is split: otherwise each
        rank of the group computes whole rows and FSDP adds their gradients, sp times the gradient. (A forward-only
        model computes whole rows correctly, only without the memory saving.)"""
        if self.par.sp_group is not None and not packs and any(p.requires_grad for p in self.model.parameters()):
            raise ValueError(f"ulysses_sequence_parallel_size={self.par.dims.sp}: {type(self.model).__name__} does "
                             "not run packed rows, which sequence parallel splits (it needs "
                             "actor_rollout_ref.model.use_remove_padding=True, a text model, and its one-time "
                             "packed check to pass: a warning above says why it failed)")

    @property
    def device(self) -> torch.device:
        return self.par.device

    @contextlib.contextmanager
    def autocast(self):
        """Sharded models compute in FSDP's param dtype (MixedPrecisionPolicy); a plain one under autocast. On a
        GPU, attention without cuDNN's per-shape plans (`attention_backends`)."""
        with attention_backends(self.device), (contextlib.nullcontext() if self.sharded
                                                else autocast(self.device, self.dtype)), \
                sequence_parallel(self.par.sp_group):
            yield

    def casts_kept(self):
        """Around a mini-batch's micro-batches: autocast's cast of each trainable weight is made by the first
        micro-batch and reused by the rest, where each forward's own autocast context would cast every weight again
        (torch keeps its casts until the outermost autocast context closes: this one, open and disabled, so the loss
        and the backward pass still run outside autocast). The weights must not change inside it: the optimizer
        steps after it. Nothing to keep for a sharded model (FSDP casts) or in float32."""
        if self.sharded or self.dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, enabled=False)

    def backward(self, loss: torch.Tensor) -> None:
        """`loss.backward()` under the forward's sdpa kernels (`attention_backends`): a layer that activation
        checkpointing recomputes in the backward pass must pick the kernel its forward picked, or it saves other
        tensors (on a GPU torch then stops: "Recomputed values ... have different metadata")."""
        with attention_backends(self.device):
            loss.backward()

    # ------------------------------------------------------------------ splitting a global batch

    def my_rows(self, batch: Batch) -> list[int]:
        """This rank's rows: an equal number of whole prompt groups per data-parallel rank, balanced by tokens
        (`trainer.balance_batch`) or in batch order. When the groups do not split evenly (a mini-batch of fewer
        prompts than ranks, say), an equal number of rows per rank in group order: whole groups where they fit,
        and a group straddles two ranks where it must. Either way the losses are normalised over the whole
        mini-batch and the advantages come from the gathered batch, so the split does not change the update."""
        if self.par.dp == 1:
            return list(range(len(batch)))
        groups = group_rows(batch.meta["uid"])
        if len(groups) % self.par.dp:
            if len(batch) % self.par.dp:
                raise ValueError(f"{len(batch)} responses cannot be split evenly over {self.par.dp} data-parallel "
                                 "ranks")
            rows = [r for g in groups for r in g]
            return sorted(rows[i] for i in balance.contiguous_parts(len(rows), self.par.dp)[self.par.dp_rank])
        if self.balance_batch:
            tokens = batch["attention_mask"].sum(-1).tolist()
            parts = balance.balanced_parts([sum(tokens[r] for r in g) for g in groups], self.par.dp, equal_count=True)
        else:
            parts = balance.contiguous_parts(len(groups), self.par.dp)
        return sorted(r for g in parts[self.par.dp_rank] for r in groups[g])

    def micro_batches(self, batch: Batch, size: int | None, *, max_tokens: int | None = None) -> list[Batch]:
        return [batch.select(p) for p in self.micro_parts(batch, size, max_tokens=max_tokens)]

    def micro_parts(self, batch: Batch, size: int | None, *, max_tokens: int | None = None,
                    packed: bool | None = None) -> list[list[int]]:
        """Row indices of micro-batches of `size` rows, or (with `max_tokens`) of rows whose size — what the
        forward computes on: their real tokens when it runs `packed` (default: `packs()`), else rows x padded
        width — is at most `max_tokens` (a longer row alone gets its own); as many on every rank (the most any rank
        needs)."""
        n = len(batch)
        if max_tokens and (self.packs() if packed is None else packed):
            lengths = batch["attention_mask"].sum(-1).tolist()
            packs = balance.token_packs(lengths, max_tokens)
            parts = balance.split_packs(packs, self.par.max(len(packs)), [0] * n, lengths,
                                        size=lambda rows: sum(lengths[i] for i in rows))
        elif max_tokens:
            prompt_lens, response_lens = padded_widths(batch)
            packs = balance.padded_packs(prompt_lens, response_lens, max_tokens)
            parts = balance.split_packs(packs, self.par.max(len(packs)), prompt_lens, response_lens)
        else:
            size = size or n
            mine = math.ceil(n / size)
            count = self.par.max(mine)
            parts = ([list(range(s, min(s + size, n))) for s in range(0, n, size)] if count == mine
                     else balance.contiguous_parts(n, count))
        return parts

    def gather_rows(self, rows: list[int], values: torch.Tensor, total: int) -> torch.Tensor:
        """Every rank's (rows, values) placed into one (total, ...) tensor, on every rank."""
        pieces = self.par.gather((rows, values.cpu()))
        width = max(v.shape[1] for _, v in pieces)
        out = torch.zeros((total, width), dtype=values.dtype)
        for r, v in pieces:
            out[r, : v.shape[1]] = v
        return out

    def per_row(self, batch: Batch, compute, *, micro_batch_size, max_tokens) -> tuple[torch.Tensor, ...]:
        """`compute(micro_batch) -> tuple of (b, L) tensors` over this rank's share, gathered for every row."""
        rows = self.my_rows(batch)
        mine = batch.select(rows)
        parts = self.micro_parts(mine, micro_batch_size, max_tokens=max_tokens)
        with self.casts_kept():
            outputs = [compute(mine.select(p)) for p in parts]
        order = [rows[i] for p in parts for i in p]
        return tuple(self.gather_rows(order, torch.cat([o[k].cpu() for o in outputs]), len(batch))
                     for k in range(len(outputs[0])))

    def sum_metrics(self, totals: dict[str, float]) -> dict[str, float]:
        """Per-rank metric shares summed over data-parallel ranks (keys are the same on every rank)."""
        keys = sorted(totals)
        summed = self.par.sum(torch.tensor([totals[k] for k in keys], dtype=torch.float64))
        return dict(zip(keys, summed.tolist()))

    # ------------------------------------------------------------------ forward and optimizer step

    def logprobs(self, mb: Batch, *, temperature: float, with_entropy: bool, router=None,
                 extra_tokens: torch.Tensor | int | None = None, routing=None) -> tuple[torch.Tensor, ...]:
        """(b, L) log-probs (and entropy) of one micro-batch's response tokens, padded back to full width; a MoE
        model's router logits recorded into `router` when given (see models/moe.py). `extra_tokens` (ids (b, L, K)
        or an int k, see models/logprobs.py) adds a third output of (b, L, K) tensors, padded the same way.
        `routing` (an entered models/router_replay.RoutingSession): the routers' choices are recorded or replayed,
        so the forward runs in one model call (prompts not shared)."""
        ids, mask, resp_l, full_l = trimmed(mb)
        extra_ids = (extra_tokens[:, :resp_l].to(self.device) if isinstance(extra_tokens, torch.Tensor)
                     else extra_tokens)
        extra = {"router": router} if router is not None else {}
        if extra_ids is not None:
            extra["extra_tokens"] = extra_ids
        with self.autocast(), (routing.paused() if routing is not None else contextlib.nullcontext()):
            packs = self.packs()  # its one-time check calls the model: not a forward of this micro-batch
        with self.autocast():
            out = self.model(ids.to(self.device), mask.to(self.device), resp_l, temperature=temperature,
                             with_entropy=with_entropy, prompts=shared_prompts(mb) if routing is None else None,
                             images=images_of(mb), packed=packs, **extra)
        logp, ent = out[0], out[1]
        pad = full_l - resp_l
        logp = torch.nn.functional.pad(logp.float(), (0, pad))
        ent = torch.nn.functional.pad(ent.float(), (0, pad)) if ent is not None else None
        if extra_ids is None:
            return logp, ent

        def widen(v):  # (b, resp_l, K) -> (b, full_l, K)
            return torch.nn.functional.pad(v if not v.is_floating_point() else v.float(), (0, 0, 0, pad))

        return logp, ent, (tuple(widen(v) for v in out[2]) if isinstance(out[2], tuple) else widen(out[2]))

    def clip_and_step(self, optimizer, grad_clip: float, offload_optimizer: bool = False, *,
                      loss_not_finite: bool = False) -> tuple[float, bool]:
        """Clip to `grad_clip` by the global norm; step only when that norm is finite and no rank's loss was
        `loss_not_finite` (else the gradients are dropped and the step counts as skipped, on every rank alike)."""
        norm = float(clip_grad_norm(self.model.parameters(), grad_clip))
        step = math.isfinite(norm) and not self.par.max(int(loss_not_finite))
        return norm, step_or_drop(optimizer, step, state_device=self.device if offload_optimizer else None)


def step_or_drop(optimizer, step: bool, *, state_device: torch.device | None = None) -> bool:
    """Take the optimizer step, or drop the gradients when `step` is False (a non-finite loss or gradient norm);
    either way no gradients are left behind, so they free their memory before the next rollout. `state_device`:
    Adam's state moves there for the step and back to CPU memory after it (optimizer_offload). Returns `step`."""
    if step and state_device is not None:
        move_optimizer_state(optimizer, state_device)
    if step:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if step and state_device is not None:
        move_optimizer_state(optimizer, torch.device("cpu"))
    return step


def move_optimizer_state(optimizer, device: torch.device) -> None:
    """Adam's moments to `device` (back to the accelerator for the step, to CPU memory between steps)."""
    for state in optimizer.state.values():
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and key != "step":
                state[key] = value.to(device, non_blocking=True)


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


def adamw_with_schedule(model, *, lr: float, weight_decay: float, warmup_steps: int, total_steps: int, style: str,
                        min_lr_ratio: float = 0.0, betas=(0.9, 0.999)):
    """AdamW over the trainable parameters and its `lr_lambda` schedule (RL's roles and SFT alike)."""
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, betas=tuple(betas), weight_decay=weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(warmup_steps, total_steps, style, min_lr_ratio))
    return opt, sched


def make_optimizer(model, optim_cfg, total_steps: int):
    """A role's optimizer and schedule from its `optim` config."""
    total = optim_cfg.total_training_steps if optim_cfg.total_training_steps > 0 else total_steps
    warmup = optim_cfg.lr_warmup_steps if optim_cfg.lr_warmup_steps > 0 else int(optim_cfg.lr_warmup_steps_ratio * total)
    return adamw_with_schedule(model, lr=optim_cfg.lr, betas=optim_cfg.betas, weight_decay=optim_cfg.weight_decay,
                               warmup_steps=warmup, total_steps=total,
                               style=optim_cfg.warmup_style or optim_cfg.lr_scheduler_type,
                               min_lr_ratio=optim_cfg.min_lr_ratio)
