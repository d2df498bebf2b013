"""Atomic checkpoints (write to a temporary folder, then rename) and resume from the latest one.

Layout: run_dir/global_step_N/{actor/, actor_optim.pt, critic/, critic_optim.pt, extra.pt} and
run_dir/latest_checkpointed_iteration.txt. A run killed while saving leaves only a `.tmp_*` folder, which is ignored.
"""

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


def save_checkpoint(run_dir: Path, step: int, roles: dict, *, tokenizer, extra: dict | None = None,
                    contents=("model", "optimizer", "extra"), keep: int | None = None) -> Path:
    """`roles` maps a name (actor, critic) to an object with .model, .optimizer, .scheduler."""
    run_dir = Path(run_dir)
    final = run_dir / f"global_step_{step}"
    tmp = run_dir / f".tmp_global_step_{step}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for name, role in roles.items():
        if "model" in contents:
            role.model.save_pretrained(tmp / name, safe_serialization=True)
            tokenizer.save_pretrained(tmp / name)
        if "optimizer" in contents:
            torch.save({"optimizer": role.optimizer.state_dict(), "scheduler": role.scheduler.state_dict()},
                       tmp / f"{name}_optim.pt")
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


def load_safetensors_dir(path: Path, exclude: str | None = None) -> dict:
    from safetensors.torch import load_file

    shards = sorted(p for p in Path(path).glob("*.safetensors") if p.name != exclude)
    if not shards:
        raise FileNotFoundError(f"{path} holds no safetensors weights")
    state = {}
    for shard in shards:
        state.update(load_file(str(shard)))
    return state


def _load_weights(model, path: Path) -> None:
    if hasattr(model, "load_weights"):
        model.load_weights(path)
        return
    missing, unexpected = model.load_state_dict(load_safetensors_dir(path), strict=False)
    missing = [k for k in missing if not k.endswith("lm_head.weight")]  # tied embeddings are saved once
    if missing or unexpected:
        raise RuntimeError(f"checkpoint {path} does not match the model: missing {missing[:5]}, unexpected {unexpected[:5]}")


def load_checkpoint(path: Path, roles: dict, *, contents=("model", "optimizer", "extra")) -> dict:
    """Restore weights / optimizer / extra state in place; returns the extra dict (with `step`)."""
    path = Path(path)
    for name, role in roles.items():
        if "model" in contents:
            _load_weights(role.model, path / name)
        optim = path / f"{name}_optim.pt"
        if "optimizer" in contents and optim.is_file():
            state = torch.load(optim, weights_only=False)
            role.optimizer.load_state_dict(state["optimizer"])
            role.scheduler.load_state_dict(state["scheduler"])
    extra = {}
    if "extra" in contents and (path / "extra.pt").is_file():
        extra = torch.load(path / "extra.pt", weights_only=False)
        set_rng_state(extra["rng"])
    return extra
