"""Picking up a run folder without losing work: which checkpoint to resume from (the newest one that loads; a
damaged one is named and skipped), whether a folder that already holds a run may be started over, and whether the
config of a resumed run still matches the one it was started with."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Callable

import yaml

from ..config import ConfigError, to_dict
from ..parallel.safeload import UnsafeCheckpoint
from .checkpoint import LATEST, complete_checkpoints, load_checkpoint

# keys a resumed run may change: how long it runs, what it logs and validates (and with which sampling), where it
# keeps checkpoints, the process layout (checkpoints reshard), and these recovery switches; a key ending in "." is a
# whole section
RUN_LENGTH_KEYS = (
    "trainer.total_training_steps", "trainer.total_epochs", "trainer.save_freq", "trainer.test_freq",
    "trainer.logger", "trainer.project_name", "trainer.experiment_name", "trainer.default_local_dir",
    "trainer.resume_mode", "trainer.resume_from_path", "trainer.val_before_train", "trainer.val_only",
    "trainer.log_val_generations", "trainer.rollout_data_dir", "trainer.validation_data_dir",
    "trainer.max_actor_ckpt_to_keep", "trainer.max_critic_ckpt_to_keep", "trainer.nnodes",
    "trainer.n_gpus_per_node", "trainer.device", "trainer.overwrite_run_dir", "trainer.resume_allow_config_change",
    "data.val_files", "data.val_batch_size", "data.val_max_samples", "actor_rollout_ref.rollout.val_kwargs.",
    "trainer.watch.",  # what the detectors watch for and do: they change no training
)


class CheckpointError(RuntimeError):
    """No checkpoint of a run folder that has some could be loaded."""


def _flat(tree: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict) and v:
            out |= _flat(v, f"{prefix}{k}.")
        else:
            out[f"{prefix}{k}"] = v
    return out


def config_changes(saved_yaml: str, cfg) -> dict[str, tuple]:
    """{key: (saved, now)} for every key that differs from the saved config, apart from RUN_LENGTH_KEYS."""
    saved, now = _flat(yaml.safe_load(saved_yaml) or {}), _flat(to_dict(cfg))
    return {k: (saved[k], now[k]) for k in sorted(saved.keys() & now.keys())
            if saved[k] != now[k] and not k.startswith(RUN_LENGTH_KEYS)}


def has_run(run_dir: Path) -> bool:
    """A folder holds a run when it has a checkpoint or logged metrics."""
    metrics = Path(run_dir) / "metrics.jsonl"
    return bool(complete_checkpoints(run_dir)) or (metrics.is_file() and metrics.stat().st_size > 0)


def check_run_dir(cfg, run_dir: Path) -> None:
    """Before anything is written to `run_dir`: refuse to start over a run (resume_mode=disable) unless
    trainer.overwrite_run_dir=True, and refuse to resume with a changed config unless
    trainer.resume_allow_config_change=True. Raises ConfigError naming the keys and the way out."""
    tr, run_dir = cfg.trainer, Path(run_dir)
    if tr.resume_mode == "disable":
        if has_run(run_dir) and not tr.overwrite_run_dir:
            found = [p.name for p in complete_checkpoints(run_dir)]
            what = f"checkpoints {', '.join(found[:3])}{' ...' if len(found) > 3 else ''}" if found else "metrics.jsonl"
            raise ConfigError(
                f"trainer.resume_mode=disable but {run_dir} already holds a run ({what}"
                + "); starting over would mix or delete its files. Use another trainer.default_local_dir, resume it "
                  "with trainer.resume_mode=auto, or set trainer.overwrite_run_dir=True to delete its checkpoints and "
                  "metrics and start over")
        return
    if tr.resume_mode == "resume_path":
        path = Path(tr.resume_from_path) if tr.resume_from_path else None
        if path is None or not path.is_dir():
            raise ConfigError(f"trainer.resume_from_path={tr.resume_from_path!r} is not a checkpoint folder "
                              "(RUN_DIR/global_step_N)")
        saved = path.parent / "config.yaml"
    else:
        if not complete_checkpoints(run_dir):
            return
        saved = run_dir / "config.yaml"
    if not saved.is_file() or tr.resume_allow_config_change:
        return
    changes = config_changes(saved.read_text(), cfg)
    if changes:
        listed = "; ".join(f"{k}: {a!r} -> {b!r}" for k, (a, b) in list(changes.items())[:12])
        more = f" (and {len(changes) - 12} more)" if len(changes) > 12 else ""
        raise ConfigError(
            f"resuming the run in {saved.parent}, but the config differs from its {saved.name} in {listed}{more}. "
            "Resume with the saved settings, start a new run in another trainer.default_local_dir, or set "
            "trainer.resume_allow_config_change=True to resume with these changes (the optimizer state, its "
            "learning rate included, still comes from the checkpoint)")


def clear_run_dir(run_dir: Path) -> None:
    """trainer.overwrite_run_dir=True with resume_mode=disable: delete the old run's checkpoints, marker and
    metrics (rank 0), so that none of them is resumed, pruned by number, or mixed into the new run's log."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return
    for p in [*run_dir.glob("global_step_*"), *run_dir.glob(".tmp_global_step_*")]:
        shutil.rmtree(p, ignore_errors=True)
    for name in (LATEST, "metrics.jsonl"):
        (run_dir / name).unlink(missing_ok=True)


def load_latest(candidates: list[Path], roles: dict, *, contents, say: Callable[[str], None]) -> tuple[Path, dict]:
    """Load the first of `candidates` (newest first) that loads. A damaged or incomplete one is reported by file
    and the previous one is tried; a file that would run code when loaded stops everything (UnsafeCheckpoint)."""
    failures = []
    for path in candidates:
        try:
            return path, load_checkpoint(path, roles, contents=contents)
        except UnsafeCheckpoint:
            raise
        except Exception as e:  # damaged, truncated or missing files, whatever the reader says about them
            reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            failures.append(f"{path.name}: {reason}")
            say(f"warning: checkpoint {path} cannot be loaded ({reason})"
                + ("; using the previous one" if path != candidates[-1] else ""))
    raise CheckpointError("no checkpoint could be loaded: " + "; ".join(failures) + ". Repair or remove them, or "
                          "start over with trainer.resume_mode=disable trainer.overwrite_run_dir=True")
