"""Atomic checkpoints (write to a temporary folder, then rename) and resume from the latest one."""

from __future__ import annotations

import os
import random
import shutil
from pathlib import Path

import torch

LATEST = "latest_checkpointed_iteration.txt"


def _write_text_atomic(path: Path, text: str) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def rng_state() -> dict:
    return {"torch": torch.get_rng_state(), "python": random.getstate()}


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])


def save_checkpoint(run_dir: Path, step: int, *, model, tokenizer, optimizer=None, scheduler=None,
                    extra: dict | None = None, contents=("model", "optimizer", "extra"), keep: int | None = None) -> Path:
    """run_dir/global_step_{step}/{actor/, optim.pt, extra.pt}; a crash mid-write leaves the previous one intact."""
    run_dir = Path(run_dir)
    final = run_dir / f"global_step_{step}"
    tmp = run_dir / f".tmp_global_step_{step}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    if "model" in contents:
        model.save_pretrained(tmp / "actor", safe_serialization=True)
        tokenizer.save_pretrained(tmp / "actor")
    if "optimizer" in contents and optimizer is not None:
        torch.save({"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict() if scheduler else None},
                   tmp / "optim.pt")
    if "extra" in contents:
        torch.save({"step": step, "rng": rng_state(), **(extra or {})}, tmp / "extra.pt")
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    _write_text_atomic(run_dir / LATEST, str(step))
    if keep:
        steps = sorted(int(p.name.rsplit("_", 1)[1]) for p in run_dir.glob("global_step_*"))
        for old in steps[:-keep]:
            shutil.rmtree(run_dir / f"global_step_{old}", ignore_errors=True)
    return final


def latest_checkpoint(run_dir: Path) -> Path | None:
    marker = Path(run_dir) / LATEST
    if not marker.is_file():
        return None
    path = Path(run_dir) / f"global_step_{int(marker.read_text().strip())}"
    return path if path.is_dir() else None


def load_checkpoint(path: Path, *, model, optimizer=None, scheduler=None, contents=("model", "optimizer", "extra")) -> dict:
    """Restore weights / optimizer / extra state in place; returns the extra dict (with `step`)."""
    from safetensors.torch import load_file

    path = Path(path)
    if "model" in contents:
        shards = sorted((path / "actor").glob("*.safetensors"))
        if not shards:
            raise FileNotFoundError(f"{path}/actor holds no safetensors weights")
        state = {}
        for shard in shards:
            state.update(load_file(str(shard)))
        missing, unexpected = model.load_state_dict(state, strict=False)
        real_missing = [k for k in missing if not k.endswith("lm_head.weight")]  # tied embeddings are saved once
        if real_missing or unexpected:
            raise RuntimeError(f"checkpoint {path} does not match the model: missing {real_missing[:5]}, unexpected {unexpected[:5]}")
    if "optimizer" in contents and optimizer is not None and (path / "optim.pt").is_file():
        state = torch.load(path / "optim.pt", weights_only=False)
        optimizer.load_state_dict(state["optimizer"])
        if scheduler is not None and state["scheduler"] is not None:
            scheduler.load_state_dict(state["scheduler"])
    extra = {}
    if "extra" in contents and (path / "extra.pt").is_file():
        extra = torch.load(path / "extra.pt", weights_only=False)
        set_rng_state(extra["rng"])
    return extra
