"""Atomic, sharded checkpoints and resume from the latest one.

Layout of `run_dir/global_step_N/`:
    actor/            Distributed Checkpoint of the actor's weights and optimizer (one shard file per rank)
    actor/hf/         what `posttrain export` needs to write a plain Hugging Face folder: config, tokenizer,
                      generation config, the LoRA adapter config, and role.json (policy or value model)
    actor_state.pt    mini-batch generator, LR scheduler, skipped-step count
    critic/, critic_state.pt   the same for the critic
    extra.pt          step, data cursor, KL controller, RNG state
and `run_dir/latest_checkpointed_iteration.txt`. Every rank writes into `.tmp_global_step_N/`; once all are done,
rank 0 renames it into place and then updates the marker. A run killed while saving leaves only the `.tmp_*`
folder, which is never loaded. A checkpoint loads into any process layout: DCP reshards on load.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path

import torch

from ..parallel import Parallel
from ..parallel.checkpoint import load_role, save_role
from ..parallel.shard import base_model

LATEST = "latest_checkpointed_iteration.txt"
CONTENTS = ("model", "optimizer", "extra", "hf_model")


def _write_text_atomic(path: Path, text: str) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def rng_state() -> dict:
    return {"torch": torch.get_rng_state(), "python": random.getstate()}


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])


def write_export_info(path: Path, model, tokenizer) -> None:
    """The config files a plain folder needs beside the weights (rank 0; no weights here)."""
    from ..models.policy import ValueModel

    path.mkdir(parents=True, exist_ok=True)
    base = base_model(model)
    base.config.save_pretrained(path)
    if getattr(base, "generation_config", None) is not None and base.can_generate():
        base.generation_config.save_pretrained(path)
    tokenizer.save_pretrained(path)
    lora = getattr(getattr(model, "lm", None), "peft_config", None)
    if lora:
        lora["default"].save_pretrained(path)
    kind = "value" if isinstance(model, ValueModel) else "policy"
    (path / "role.json").write_text(json.dumps({"kind": kind, "lora": bool(lora)}))


def save_checkpoint(run_dir: Path, step: int, roles: dict, par: Parallel, *, tokenizer, extra: dict | None = None,
                    contents=("model", "optimizer", "extra"), keep: int | None = None) -> Path:
    """`roles` maps a name (actor, critic) to an object with .model, .optimizer and counters(). Every rank calls
    this (the weights are written by all of them)."""
    unknown = sorted(set(contents) - set(CONTENTS))
    if unknown:
        raise ValueError(f"checkpoint.save_contents: unknown entries {unknown}; use some of {list(CONTENTS)}")
    run_dir = Path(run_dir)
    final = run_dir / f"global_step_{step}"
    tmp = run_dir / f".tmp_global_step_{step}"
    if par.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    par.barrier()
    for name, role in roles.items():
        if "model" in contents or "optimizer" in contents:
            save_role(tmp / name, role.model, role.optimizer if "optimizer" in contents else None)
        if par.is_main:
            write_export_info(tmp / name / "hf", role.model, tokenizer)
            torch.save(role.counters(), tmp / f"{name}_state.pt")
    if par.is_main and "extra" in contents:
        torch.save({"step": step, "rng": rng_state(), **(extra or {})}, tmp / "extra.pt")
    par.barrier()
    if par.is_main:
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        _write_text_atomic(run_dir / LATEST, str(step))
        if "hf_model" in contents:
            from .export import export_checkpoint

            for name in roles:
                export_checkpoint(final, final / name / "huggingface", role=name)
        if keep:
            steps = sorted(int(p.name.rsplit("_", 1)[1]) for p in run_dir.glob("global_step_*"))
            for old in steps[:-keep]:
                shutil.rmtree(run_dir / f"global_step_{old}", ignore_errors=True)
    par.barrier()
    return final


def latest_checkpoint(run_dir: Path) -> Path | None:
    marker = Path(run_dir) / LATEST
    if not marker.is_file():
        return None
    path = Path(run_dir) / f"global_step_{int(marker.read_text().strip())}"
    return path if path.is_dir() else None


def load_checkpoint(path: Path, roles: dict, *, contents=("model", "optimizer", "extra")) -> dict:
    """Restore weights / optimizer / counters / extra state in place (every rank); returns the extra dict."""
    path = Path(path)
    for name, role in roles.items():
        if not (path / name).is_dir():
            raise FileNotFoundError(f"checkpoint {path} has no '{name}' (was it saved by a run with a {name}?)")
        if "model" in contents or "optimizer" in contents:
            load_role(path / name, role.model, role.optimizer if "optimizer" in contents else None)
        state = path / f"{name}_state.pt"
        if state.is_file():
            role.load_counters(torch.load(state, weights_only=True))
    extra = {}
    if "extra" in contents and (path / "extra.pt").is_file():
        extra = torch.load(path / "extra.pt", weights_only=True)
        set_rng_state(extra["rng"])
    return extra
