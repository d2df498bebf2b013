"""Supervised fine-tuning: cross-entropy on response tokens only, same data layer as RL; keeps the checkpoint
with the lowest dev loss (early stopping on a dev set, never on the test set)."""

from __future__ import annotations

import json
import math
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from ..data.dataset import SFTDataset
from ..progress import ProgressBar
from ..host_memory import keep_freed_memory
from ..models.load import autocast, compute_dtype, load_causal_lm, load_tokenizer, pick_device
from ..models.vision import forward_inputs, freeze_vision_tower, is_vision_config, load_vision_processor
from ..roles.common import adamw_with_schedule, step_or_drop
from ..roles.nonfinite import NonFiniteGuard
from .checkpoint import _write_text_atomic, publish


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
    missing_chat_template: str = "error"  # a tokenizer without one: "error", or "join" the contents by newlines
    max_nonfinite_updates_in_a_row: int = 5  # skipped (NaN/inf loss or gradient) updates before stopping; 0 = never
    freeze_vision_tower: bool = False  # vision-language models: the vision encoder keeps its weights
    stop_when: Callable | None = None  # library use: asked with the model at each evaluation; True ends training


def check_sft_args(args: SFTArgs) -> None:
    """Every bad setting at once, as a ConfigError naming the command-line flag, before anything loads."""
    from ..config.loader import ConfigError

    def positive(value, flag, *, zero_ok=False, whole=True):
        kinds = int if whole else (int, float)
        ok = (isinstance(value, kinds) and not isinstance(value, bool) and math.isfinite(value)
              and (value >= 0 if zero_ok else value > 0))
        what = ("a whole number " if whole else "") + (">= 0" if zero_ok else "> 0")
        return None if ok else f"{flag}={value!r} must be {what}"

    problems = [positive(args.batch_size, "--batch-size"), positive(args.epochs, "--epochs", whole=False),
                positive(args.lr, "--lr", zero_ok=True, whole=False), positive(args.max_length, "--max-length"),
                positive(args.eval_every, "--eval-every"), positive(args.patience, "--patience", zero_ok=True),
                positive(args.weight_decay, "weight_decay", zero_ok=True, whole=False),
                positive(args.max_nonfinite_updates_in_a_row, "--max-nonfinite-updates-in-a-row", zero_ok=True)]
    if not 0 <= args.warmup_ratio < 1:
        problems.append(f"warmup_ratio={args.warmup_ratio} must lie in [0, 1)")
    if args.missing_chat_template not in ("error", "join"):
        problems.append(f"--missing-chat-template={args.missing_chat_template!r} is not one of ['error', 'join']")
    if not args.train_files:
        problems.append("--train-files names no file")
    for flag, files in (("--train-files", args.train_files), ("--val-files", args.val_files or [])):
        for f in [files] if isinstance(files, (str, Path)) else files:
            if not Path(f).is_file():
                problems.append(f"{flag}: '{f}' does not exist (or is not a file)")
    problems = [p for p in problems if p]
    if len(problems) == 1:
        raise ConfigError(problems[0])
    if problems:
        raise ConfigError(f"{len(problems)} problems; nothing was started:\n" + "\n".join(f"  - {p}" for p in problems))


def _loss(model, ids, attn, loss_mask, device, dtype, images=None) -> tuple[torch.Tensor, int]:
    """Summed token cross-entropy of the response tokens, and their count. `images`: each row's image inputs for
    a vision-language model (models/vision.py)."""
    ids, attn = ids.to(device), attn.to(device)
    extra = forward_inputs(model, model.config, ids, attn, images) if is_vision_config(model.config) else {}
    with autocast(device, dtype):
        logits = model(input_ids=ids, attention_mask=attn, **extra).logits[:, :-1].float()
    target = ids[:, 1:].to(device)
    mask = loss_mask[:, 1:].to(device).float()
    nll = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1), reduction="none")
    return (nll * mask.reshape(-1)).sum(), int(mask.sum())


@torch.no_grad()
def dev_loss(model, data: SFTDataset, pad_id, device, dtype, batch_size) -> float:
    model.eval()
    total, count = 0.0, 0
    for start in range(0, len(data), batch_size):
        rows = range(start, min(start + batch_size, len(data)))
        ids, attn, lm = data.collate(rows, pad_id)
        s, n = _loss(model, ids, attn, lm, device, dtype, [data.images[i] for i in rows])
        total, count = total + float(s), count + n
    model.train()
    return total / max(count, 1)


def run_sft(args: SFTArgs) -> dict:
    """Train, evaluate the dev loss (and ask `stop_when`) every `eval_every` steps, save the best (or last) model to
    output_dir."""
    check_sft_args(args)
    torch.manual_seed(args.seed)
    device, out = pick_device(args.device), Path(args.output_dir)
    if torch.device(device).type == "cpu":
        keep_freed_memory()
    dtype = compute_dtype(args.dtype, device)
    tok = load_tokenizer(args.model_path, key="--model")
    processor = load_vision_processor(args.model_path, tok, key="--model")  # None for a text-only model
    data_kwargs = dict(prompt_key=args.prompt_key, response_key=args.response_key, max_length=args.max_length,
                       missing_chat_template=args.missing_chat_template, processor=processor)
    train = SFTDataset(args.train_files, tok, **data_kwargs)  # bad rows are found before the model loads
    dev = SFTDataset(args.val_files, tok, **data_kwargs) if args.val_files else None
    model = load_causal_lm(args.model_path, device=device, key="--model")
    if args.freeze_vision_tower:
        freeze_vision_tower(model, option="--freeze-vision-tower")
    guard = NonFiniteGuard("sft", args.max_nonfinite_updates_in_a_row)
    steps_per_epoch = math.ceil(len(train) / args.batch_size)
    total = max(1, int(args.epochs * steps_per_epoch))
    opt, sched = adamw_with_schedule(model, lr=args.lr, weight_decay=args.weight_decay,
                                     warmup_steps=int(args.warmup_ratio * total), total_steps=total, style="cosine")
    gen = torch.Generator().manual_seed(args.seed)
    best, best_step, bad, history = float("inf"), 0, 0, []
    order = torch.randperm(len(train), generator=gen)
    pos, t0 = 0, time.time()
    model.train()
    bar = ProgressBar("sft", total, unit="steps", enabled=not args.quiet)
    try:
        for step in range(1, total + 1):
            if pos + args.batch_size > len(train):
                order, pos = torch.randperm(len(train), generator=gen), 0
            idx = order[pos:pos + args.batch_size].tolist()
            pos += args.batch_size
            ids, attn, lm = train.collate(idx, tok.pad_token_id)
            s, n = _loss(model, ids, attn, lm, device, dtype, [train.images[i] for i in idx])
            loss = s / max(n, 1)
            loss_not_finite = guard.loss_not_finite(loss, [("loss", loss)])
            loss.backward()
            # torch's clip, not parallel.clip_grad_norm (for sharded models): the two round differently in the
            # last bits, and SFT's weights (and the step it keeps) would change with the swap
            grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0))
            stepped = step_or_drop(opt, not loss_not_finite and math.isfinite(grad_norm))
            guard.after_update(stepped, grad_norm)  # raises after too many skipped updates in a row
            sched.step()
            bar.update(step)
            if step % args.eval_every == 0 or step == total:
                record = {"step": step, "train_loss": loss.item(), "time_s": round(time.time() - t0, 1)}
                if dev is not None:
                    record["dev_loss"] = dev_loss(model, dev, tok.pad_token_id, device, dtype, args.batch_size * 4)
                    if record["dev_loss"] < best - 1e-4:
                        best, best_step, bad = record["dev_loss"], step, 0
                        _save(model, tok, out, processor)
                    else:
                        bad += 1
                history.append(record)
                if not args.quiet:
                    bar.print("sft " + " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                                                for k, v in record.items()))
                if dev is not None and args.patience and bad >= args.patience:
                    if not args.quiet:
                        bar.print(f"sft stopped early at step {step}: no lower dev loss in {bad} evaluations")
                    break
                if args.stop_when is not None and _stop(args.stop_when, model):
                    break
    finally:
        bar.close()
    if dev is None:
        _save(model, tok, out, processor)
        best_step = step
    _write_text_atomic(out / "sft_history.json", json.dumps({"best_step": best_step, "history": history}, indent=1))
    return {"best_step": best_step, "best_dev_loss": best if dev is not None else None, "steps": step}


@torch.no_grad()
def _stop(stop_when, model) -> bool:
    model.eval()
    try:
        return bool(stop_when(model))
    finally:
        model.train()


def remove_model(out: Path) -> None:
    """Remove an SFT output folder: the link `_save` publishes (or a plain folder from before) and its versions."""
    out = Path(out)
    if out.is_symlink():
        out.unlink()
    else:
        shutil.rmtree(out, ignore_errors=True)
    shutil.rmtree(out.with_name(f".{out.name}.versions"), ignore_errors=True)


def _save(model, tok, out: Path, processor=None) -> None:
    """Write the model as a new version beside `out` and point `out` (a symlink) at it with one rename, the way RL
    checkpoints are published: a crash at any moment leaves `out` naming a complete model, the previous best or the
    new one (a plain folder left by an earlier posttrain is moved into the versions first: for that one switch `out`
    is briefly absent, the model safe beside it). The versions live in the hidden folder `.<name>.versions` next to
    `out`; older ones are removed once the new one is in place."""
    versions = out.with_name(f".{out.name}.versions")
    versions.mkdir(parents=True, exist_ok=True)
    number = 1 + max((int(p.name.split("_")[1]) for p in versions.glob("model_*") if p.name.split("_")[1].isdigit()),
                     default=0)
    tmp, final = versions / f".tmp_model_{number}", versions / f"model_{number}"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    tok.save_pretrained(tmp)
    if processor is not None:  # a VL model's directory keeps its image processor (and processor, if built)
        (processor.processor or processor.image_processor).save_pretrained(tmp)
    history = out / "sft_history.json"
    if history.is_file():
        shutil.copy(history, tmp / history.name)
    publish(tmp, final)
    if out.is_dir() and not out.is_symlink():  # a plain folder from before (an earlier run's model) goes aside,
        shutil.rmtree(versions / ".earlier", ignore_errors=True)  # whole, and is removed with the older versions
        os.replace(out, versions / ".earlier")
    link = out.with_name(f".{out.name}.link")
    link.unlink(missing_ok=True)
    link.symlink_to(os.path.relpath(final, out.parent))
    os.replace(link, out)
    for old in versions.iterdir():
        if old != final:
            shutil.rmtree(old, ignore_errors=True)
