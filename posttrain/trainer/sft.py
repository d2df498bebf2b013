"""Supervised fine-tuning: cross-entropy on response tokens only, same data layer as RL; keeps the checkpoint
with the lowest dev loss (early stopping on a dev set, never on the test set)."""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ..data.dataset import SFTDataset
from ..models.load import autocast, compute_dtype, load_causal_lm, load_tokenizer, pick_device
from .checkpoint import _write_text_atomic


@dataclass
class SFTArgs:
    model_path: str
    train_files: list
    output_dir: str
    val_files: list | None = None
    prompt_key: str = "prompt"
    response_key: str = "response"
    epochs: float = 1.0
    lr: float = 1e-4
    weight_decay: float = 0.0
    warmup_ratio: float = 0.05
    batch_size: int = 32
    max_length: int = 1024
    eval_every: int = 100
    patience: int = 0  # evaluations without dev improvement before stopping; 0 = never stop early
    seed: int = 0
    device: str = "auto"
    dtype: str = "auto"
    quiet: bool = False


def _loss(model, ids, attn, loss_mask, device, dtype) -> tuple[torch.Tensor, int]:
    """Summed token cross-entropy of the response tokens, and their count."""
    with autocast(device, dtype):
        logits = model(input_ids=ids.to(device), attention_mask=attn.to(device)).logits[:, :-1].float()
    target = ids[:, 1:].to(device)
    mask = loss_mask[:, 1:].to(device).float()
    nll = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1), reduction="none")
    return (nll * mask.reshape(-1)).sum(), int(mask.sum())


@torch.no_grad()
def dev_loss(model, data: SFTDataset, pad_id, device, dtype, batch_size) -> float:
    model.eval()
    total, count = 0.0, 0
    for start in range(0, len(data), batch_size):
        ids, attn, lm = data.collate(range(start, min(start + batch_size, len(data))), pad_id)
        s, n = _loss(model, ids, attn, lm, device, dtype)
        total, count = total + float(s), count + n
    model.train()
    return total / max(count, 1)


def run_sft(args: SFTArgs) -> dict:
    """Train, evaluate the dev loss every `eval_every` steps, save the best (or last) model to output_dir."""
    torch.manual_seed(args.seed)
    device, out = pick_device(args.device), Path(args.output_dir)
    dtype = compute_dtype(args.dtype, device)
    tok = load_tokenizer(args.model_path, key="--model")
    model = load_causal_lm(args.model_path, device=device, key="--model")
    train = SFTDataset(args.train_files, tok, prompt_key=args.prompt_key, response_key=args.response_key,
                       max_length=args.max_length)
    dev = SFTDataset(args.val_files, tok, prompt_key=args.prompt_key, response_key=args.response_key,
                     max_length=args.max_length) if args.val_files else None
    steps_per_epoch = math.ceil(len(train) / args.batch_size)
    total = max(1, int(args.epochs * steps_per_epoch))
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    warmup = int(args.warmup_ratio * total)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: (s + 1) / warmup if s < warmup else 0.5 * (1 + math.cos(math.pi * (s - warmup) / max(total - warmup, 1))))
    gen = torch.Generator().manual_seed(args.seed)
    best, best_step, bad, history = float("inf"), 0, 0, []
    order = torch.randperm(len(train), generator=gen)
    pos, t0 = 0, time.time()
    model.train()
    for step in range(1, total + 1):
        if pos + args.batch_size > len(train):
            order, pos = torch.randperm(len(train), generator=gen), 0
        idx = order[pos:pos + args.batch_size].tolist()
        pos += args.batch_size
        ids, attn, lm = train.collate(idx, tok.pad_token_id)
        s, n = _loss(model, ids, attn, lm, device, dtype)
        loss = s / max(n, 1)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if step % args.eval_every == 0 or step == total:
            record = {"step": step, "train_loss": loss.item(), "time_s": round(time.time() - t0, 1)}
            if dev is not None:
                record["dev_loss"] = dev_loss(model, dev, tok.pad_token_id, device, dtype, args.batch_size * 4)
                if record["dev_loss"] < best - 1e-4:
                    best, best_step, bad = record["dev_loss"], step, 0
                    _save(model, tok, out)
                else:
                    bad += 1
            history.append(record)
            if not args.quiet:
                print("sft " + " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in record.items()),
                      flush=True)
            if dev is not None and args.patience and bad >= args.patience:
                break
    if dev is None:
        _save(model, tok, out)
        best_step = step
    _write_text_atomic(out / "sft_history.json", json.dumps({"best_step": best_step, "history": history}, indent=1))
    return {"best_step": best_step, "best_dev_loss": best if dev is not None else None, "steps": step}


def _save(model, tok, out: Path) -> None:
    import shutil

    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    tok.save_pretrained(tmp)
    keep = out / "sft_history.json"
    if keep.is_file():
        shutil.copy(keep, tmp / keep.name)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
