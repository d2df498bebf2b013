"""Atomic, sharded checkpoints and resume from the latest one.

Layout of `run_dir/global_step_N/`:
    actor/            Distributed Checkpoint of the actor's weights and optimizer (one shard file per rank)
    actor/hf/         what `posttrain export` needs to write a plain Hugging Face folder: config, tokenizer,
                      generation config, the LoRA adapter config, and role.json (policy or value model)
    actor_state.pt    mini-batch generator, LR scheduler, skipped-step count
    critic/, critic_state.pt   the same for the critic
    extra.pt          step, data cursor, KL controller, RNG state
    actor/huggingface/  with `hf_model`: a plain Hugging Face folder, written after publishing (export_later)
and `run_dir/latest_checkpointed_iteration.txt`. Every rank writes into `.tmp_global_step_N/`; once all are done,
rank 0 renames it into place and then updates the marker. A run killed while saving leaves only the `.tmp_*`
folder, which is never loaded; the latest checkpoint is found by scanning the published folders (the marker is kept
for tools that read it). A checkpoint loads into any process layout: DCP reshards on load. Every file is read
without unpickling arbitrary objects (parallel/safeload.py).
"""

from __future__ import annotations

import json
import os
import random
import shutil
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

from ..parallel import Parallel
from ..parallel.checkpoint import load_role, save_role
from ..parallel.safeload import load_plain
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
    from ..models.vision import copy_processor_files

    path.mkdir(parents=True, exist_ok=True)
    base = base_model(model)
    base.config.save_pretrained(path)
    if getattr(base, "generation_config", None) is not None and base.can_generate():
        base.generation_config.save_pretrained(path)
    tokenizer.save_pretrained(path)
    copy_processor_files(getattr(base, "name_or_path", None), path)  # a VL model's image processor
    lora = getattr(getattr(model, "lm", None), "peft_config", None)
    if lora:
        lora["default"].save_pretrained(path)
    kind = "value" if isinstance(model, ValueModel) else "policy"
    (path / "role.json").write_text(json.dumps({"kind": kind, "lora": bool(lora)}))


class CheckpointWriteError(RuntimeError):
    """A checkpoint could not be written (disk full, read-only folder, ...); earlier checkpoints are untouched."""


def _os_error(exc: BaseException) -> OSError | None:
    """The OSError behind `exc`, also when Distributed Checkpoint wrapped it in its per-rank failure report."""
    seen = set()
    todo = [exc]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError):
            return e
        wrapped = getattr(e, "failures", {}).values()  # DCP: rank -> (exception, traceback)
        todo += [e.__cause__, e.__context__, *(w[0] if isinstance(w, tuple) else w for w in wrapped)]
    return None


def _write_failed(exc: BaseException, writing: Path, step: int, run_dir: Path) -> CheckpointWriteError:
    err = _os_error(exc)
    what = (err.strerror or str(err)).lower() if err is not None else f"{type(exc).__name__}: {exc}"
    where = Path(err.filename) if err is not None and err.filename else writing
    kept = [p.name for p in complete_checkpoints(run_dir)]
    return CheckpointWriteError(
        f"{what} while writing {where}: checkpoint global_step_{step} was not saved and its temporary folder was "
        f"removed; " + (f"the earlier checkpoints are intact ({', '.join(kept)})" if kept else "no earlier checkpoint "
                        "exists") + f". Free space or fix the permissions of {run_dir} and run the same command again "
        "to resume.")


def save_checkpoint(run_dir: Path, step: int, roles: dict, par: Parallel, *, tokenizer, extra: dict | None = None,
                    contents=("model", "optimizer", "extra"), keep: int | None = None) -> Path:
    """`roles` maps a name (actor, critic) to an object with .model, .optimizer and counters(). Every rank calls
    this (the weights are written by all of them). A failed write removes the temporary folder and raises
    CheckpointWriteError; the checkpoints already there are never touched by it."""
    unknown = sorted(set(contents) - set(CONTENTS))
    if unknown:
        raise ValueError(f"checkpoint.save_contents: unknown entries {unknown}; use some of {list(CONTENTS)}")
    run_dir = Path(run_dir)
    final = run_dir / f"global_step_{step}"
    tmp = run_dir / f".tmp_global_step_{step}"
    writing = tmp
    try:
        if par.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        par.barrier()
        for name, role in roles.items():
            if "model" in contents or "optimizer" in contents:
                writing = tmp / name
                save_role(tmp / name, role.model, role.optimizer if "optimizer" in contents else None)
            if par.is_main:
                writing = tmp / name / "hf"
                write_export_info(tmp / name / "hf", role.model, tokenizer)
                writing = tmp / f"{name}_state.pt"
                torch.save(role.counters(), writing)
        write_window(tmp)
        if par.is_main and "extra" in contents:
            writing = tmp / "extra.pt"
            torch.save({"step": step, "rng": rng_state(), **(extra or {})}, writing)
        par.barrier()
        if par.is_main:
            writing = final
            publish(tmp, final)
            writing = run_dir / LATEST
            _write_text_atomic(run_dir / LATEST, str(step))
    except BaseException as e:  # DCP reports a rank's failure as a BaseException
        if par.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        raise _write_failed(e, writing, step, run_dir) from e
    if par.is_main and keep:
        prune(run_dir, step, keep)
    par.barrier()
    if par.is_main and "hf_model" in contents:
        export_later(final, list(roles))
    return final


_exporter: ThreadPoolExecutor | None = None  # rank 0's one background thread for hf_model exports, in save order
_exports: list[Future] = []
_exporting: set[Path] = set()  # checkpoints whose export is queued or under way: prune leaves them


def export_later(final: Path, names: list[str]) -> None:
    """Write each role's plain Hugging Face folder (`final/<role>/huggingface`) of the published checkpoint `final`
    in a background thread of rank 0. A large model's export takes minutes; no rank waits for it (the other ranks
    held in a collective meanwhile would pass its time limit), and training goes on beside it. The export reads the
    checkpoint's files, not the live model, and runs no collective. A failed export is reported as what it is: the
    checkpoint is saved and resumable, its Hugging Face folder is missing (`posttrain export` writes it later)."""
    global _exporter
    if _exporter is None:
        _exporter = ThreadPoolExecutor(1, thread_name_prefix="hf_export")
    _exporting.add(final)
    _exports.append(_exporter.submit(_export, final, names))


def _export(final: Path, names: list[str]) -> None:
    import sys

    from . import export

    try:
        for name in names:
            out, tmp = final / name / "huggingface", final / name / ".tmp_huggingface"
            try:
                export.export_checkpoint(final, tmp, role=name)
                publish(tmp, out)
            except Exception as e:  # noqa: BLE001 - reported; the checkpoint itself is complete
                shutil.rmtree(tmp, ignore_errors=True)
                role = f" --role {name}" if name != "actor" else ""
                print(f"warning: checkpoint {final} is saved and the run can resume from it, but writing its Hugging "
                      f"Face folder {out} failed ({type(e).__name__}: {e}); write it with `posttrain export {final} "
                      f"{out}{role}`", file=sys.stderr, flush=True)
    finally:
        _exporting.discard(final)


def finish_exports() -> None:
    """Wait for the exports under way; rank 0 calls it after the job's last collective, so no rank waits with it."""
    while _exports:
        _exports.pop(0).result()


def publish(tmp: Path, final: Path) -> None:
    """Put the finished folder `tmp` in place as `final` with one rename: a reader, or a run killed at any moment,
    finds the whole folder or none of it. `final` is a new name (a step number, an SFT model's version); only a
    folder that a resumed run writes again (a damaged checkpoint it skipped) is replaced, and is not being read."""
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)


def write_window(path: Path) -> None:
    """Crash tests widen the middle of a checkpoint write (weights written, extra.pt not yet, nothing published)
    to POSTTRAIN_CKPT_PAUSE seconds and learn when it starts (a line on stderr), so that a kill lands inside it."""
    pause = float(os.environ.get("POSTTRAIN_CKPT_PAUSE", "0") or 0)
    if pause > 0:
        import sys
        import time

        print(f"[checkpoint write under way] {path}", file=sys.stderr, flush=True)
        time.sleep(pause)


def prune(run_dir: Path, step: int, keep: int) -> None:
    """Keep the newest `keep` complete checkpoints up to `step` (the one just written is always kept; a
    checkpoint with a higher step number is never deleted by this)."""
    older = [p for p in complete_checkpoints(run_dir) if checkpoint_step(p) < step]
    for p in older[max(keep - 1, 0):]:
        if p not in _exporting:  # its export is still reading it: a later save prunes it
            shutil.rmtree(p, ignore_errors=True)


def checkpoint_step(path: Path) -> int:
    return int(Path(path).name.rsplit("_", 1)[1])


def complete_checkpoints(run_dir: Path) -> list[Path]:
    """The published checkpoints of `run_dir`, newest first. A checkpoint is published by renaming its finished
    temporary folder, so each `global_step_N` folder was complete when written (a later loss of files shows at
    load time); `.tmp_*` folders of a write that was cut short are never among them."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return []
    found = [p for p in run_dir.glob("global_step_*") if p.is_dir() and p.name.rsplit("_", 1)[1].isdigit()]
    return sorted(found, key=checkpoint_step, reverse=True)


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The newest published checkpoint, found by scanning (the marker file may be stale or gone)."""
    found = complete_checkpoints(run_dir)
    return found[0] if found else None


def load_checkpoint(path: Path, roles: dict, *, contents=("model", "optimizer", "extra")) -> dict:
    """Restore weights / optimizer / counters / extra state in place (every rank); returns the extra dict. Every
    file is read without running code (UnsafeCheckpoint otherwise); a missing or damaged file raises OSError
    naming it."""
    path = Path(path)
    for name in roles:
        if not (path / name).is_dir():
            raise FileNotFoundError(f"checkpoint {path} has no '{name}' (was it saved by a run with a {name}?)")
    if "extra" in contents and not (path / "extra.pt").is_file():
        raise FileNotFoundError(f"{path / 'extra.pt'} is missing")
    counters = {name: load_plain(path / f"{name}_state.pt") for name in roles if (path / f"{name}_state.pt").is_file()}
    extra = load_plain(path / "extra.pt") if "extra" in contents else {}
    for name, role in roles.items():
        if "model" in contents or "optimizer" in contents:
            load_role(path / name, role.model, role.optimizer if "optimizer" in contents else None)
        if name in counters:
            role.load_counters(counters[name])
    if extra:
        set_rng_state(extra["rng"])
    return extra
