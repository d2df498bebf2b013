"""Metric sinks: a JSONL file in the run folder (always), the console (progress bar with ETA and a compact
per-step table), tensorboard, and wandb / mlflow when installed (the `tracking` extra). Every sink gets the same
metric names; mlflow alone spells `@` as `_at_` (it refuses the character). wandb and mlflow also get the run's
config (wandb as its nested config, mlflow as params with dotted keys)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from ..config import ConfigError
from ..progress import ProgressBar

CONSOLE_KEYS = ("critic/score/mean", "val-core", "actor/pg_loss", "actor/kl_loss", "actor/entropy", "actor/grad_norm",
                "response_length/mean", "batch/zero_std_group_frac", "timing_s/step")


class MetricsWriteError(OSError):
    """metrics.jsonl could not take a line (disk full, ...); the file is left ending with a whole line."""


class Tracker:
    def __init__(self, loggers: list[str], run_dir: Path, total_steps: int, *, project: str = "", name: str = "",
                 config: dict | None = None, resumed_step: int = 0):
        self.run_dir, self.total_steps = Path(run_dir), total_steps
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.jsonl = self._open_jsonl(self.run_dir / "metrics.jsonl", resumed_step)
        self.console = "console" in loggers
        self.start = time.time()
        self.tb = self.wandb = self.mlflow = None
        if "tensorboard" in loggers:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(self.run_dir / "tensorboard"))
        if "wandb" in loggers or "mlflow" in loggers:
            try:
                if "wandb" in loggers:
                    import wandb

                    try:
                        self.wandb = wandb.init(project=project, name=name, config=config, dir=str(self.run_dir))
                    except wandb.Error as e:  # e.g. no API key: a setup problem, not a crash
                        raise ConfigError(f"trainer.logger=wandb: wandb could not start ({e}); log in with `wandb "
                                          "login`, set WANDB_API_KEY, or WANDB_MODE=offline") from None
                if "mlflow" in loggers:
                    self.mlflow = _start_mlflow(project, name, config)
            except ImportError as e:
                raise RuntimeError(f"trainer.logger asks for {e.name}; install it with pip install 'posttrain[tracking]'") from None
        self._progress = ProgressBar("step", total_steps, completed=resumed_step) if self.console else None

    @staticmethod
    def _open_jsonl(path: Path, resumed_step: int):
        """A fresh run starts an empty file; a resumed one keeps the lines up to its checkpoint (a killed run may
        have logged steps after it, which will be run again). A line cut short by a crash or a full disk is dropped.
        The kept lines are written to a new file that replaces the old one, so a kill here loses nothing."""
        kept = []
        if resumed_step > 0 and path.is_file():
            for line in path.read_text(errors="replace").splitlines():
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if row.get("step", 0) <= resumed_step:
                    kept.append(line)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text("".join(line + "\n" for line in kept))
        os.replace(tmp, path)
        return path.open("ab", buffering=0)  # unbuffered: each line reaches the file in one write

    def log(self, metrics: dict[str, float], step: int) -> None:
        clean = {k: float(v) for k, v in metrics.items()}
        self._append(json.dumps({"step": step, **clean}) + "\n")
        if self.tb:
            for k, v in clean.items():
                self.tb.add_scalar(k, v, step)
        if self.wandb:
            self.wandb.log(clean, step=step)
        if self.mlflow:
            self.mlflow.log_metrics({mlflow_name(k): v for k, v in clean.items()}, step=step)
        if self.console:
            shown = [(k, v) for k, v in clean.items() if k.startswith(CONSOLE_KEYS)]
            line = "  ".join(f"{k.split('/', 1)[-1] if not k.startswith('val') else k}={v:.4g}" for k, v in shown)
            self._progress.print(f"[dim]step {step:>4}[/dim] {line}", markup=True)

    def _append(self, line: str) -> None:
        """One line, all or nothing: a write that fails part way (disk full) is cut back to the previous line."""
        data = line.encode()
        end = self.jsonl.tell()
        try:
            written = self.jsonl.write(data)
            if written != len(data):
                raise OSError(28, "No space left on device")
        except OSError as e:
            try:
                self.jsonl.truncate(end)
                self.jsonl.seek(end)
            except OSError:
                pass
            raise MetricsWriteError(e.errno, f"{(e.strerror or str(e)).lower()} while writing "
                                             f"{self.run_dir / 'metrics.jsonl'} (the lines already written are "
                                             "intact; the last checkpoint resumes the run)") from None

    def advance(self, step: int) -> None:
        if self._progress:
            self._progress.update(step)

    def close(self) -> None:
        if self._progress:
            self._progress.close()
        self.jsonl.close()
        if self.tb:
            self.tb.close()
        if self.wandb:
            self.wandb.finish()
        if self.mlflow:
            self.mlflow.end_run()


def mlflow_name(key: str) -> str:
    """A metric name as mlflow stores it: mlflow refuses "@", so `mean@4` is logged as `mean_at_4`."""
    return key.replace("@", "_at_")


def flat_params(config: dict, prefix: str = "") -> dict[str, str]:
    """A nested config as mlflow's flat params: dotted keys (`actor_rollout_ref.actor.optim.lr`), values as text."""
    out = {}
    for key, value in config.items():
        if isinstance(value, dict) and value:
            out |= flat_params(value, f"{prefix}{key}.")
        else:
            out[f"{prefix}{key}"] = str(value)
    return out


def _start_mlflow(project: str, name: str, config: dict | None = None):
    """mlflow with its run started, where MLFLOW_TRACKING_URI points (a server, sqlite:///mlflow.db, or a folder),
    and the run's config logged as its params; a store it cannot open is a setup problem, said in one line."""
    import mlflow
    from mlflow.exceptions import MlflowException
    from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH

    try:
        mlflow.set_experiment(project)
        mlflow.start_run(run_name=name)
        if config:
            mlflow.log_params({k: v[:MAX_PARAM_VAL_LENGTH] for k, v in flat_params(config).items()})
    except (MlflowException, ImportError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(f"trainer.logger=mlflow: mlflow could not open its tracking store "
                          f"{mlflow.get_tracking_uri()!r} ({first}); set MLFLOW_TRACKING_URI to a server or "
                          "sqlite:///mlflow.db (needs the full mlflow package), or to a folder (file:./mlruns) with "
                          "MLFLOW_ALLOW_FILE_STORE=true") from None
    return mlflow


class NullTracker:
    """What ranks other than 0 log: nothing (rank 0 holds every metric already)."""

    def log(self, metrics: dict[str, float], step: int) -> None:
        pass

    def advance(self, step: int) -> None:
        pass

    def close(self) -> None:
        pass
