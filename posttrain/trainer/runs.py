"""`posttrain runs [FOLDER]`: the runs in a folder as one table — algorithm, steps, last training reward, last
validation accuracy, latest checkpoint — read from what every run leaves behind (config.yaml, metrics.jsonl,
latest_checkpointed_iteration.txt; SFT runs: sft_history.json)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import yaml

from .checkpoint import latest_checkpoint
from .plots import read_metrics

MAX_DEPTH = 4  # folders below FOLDER searched for runs


@dataclass
class RunInfo:
    path: Path
    algorithm: str
    steps: str
    reward: float | None
    accuracy: float | None
    accuracy_sources: int
    checkpoint: str


def _algorithm(config: dict) -> str:
    """adv_estimator, plus the policy loss when it is not the PPO-clip default (e.g. `grpo + gpg`)."""
    algo = (config.get("algorithm") or {}).get("adv_estimator", "?")
    loss = (((config.get("actor_rollout_ref") or {}).get("actor") or {}).get("policy_loss") or {}).get("loss_mode")
    return f"{algo} + {loss}" if loss and loss != "vanilla" else algo


def rl_run(path: Path) -> RunInfo:
    config_file = path / "config.yaml"
    config = yaml.safe_load(config_file.read_text()) if config_file.is_file() else {}
    rows = read_metrics(path)
    last = max((r["step"] for r in rows), default=0)
    total = ((config.get("trainer") or {}).get("total_training_steps")) if config else None
    reward = next((r["critic/score/mean"] for r in reversed(rows) if "critic/score/mean" in r), None)
    val = next(({k: v for k, v in r.items() if k.startswith("val-core/")} for r in reversed(rows)
                if any(k.startswith("val-core/") for k in r)), {})
    ckpt = latest_checkpoint(path)
    return RunInfo(path, _algorithm(config) if config else "?", f"{last}/{total}" if total else str(last), reward,
                   sum(val.values()) / len(val) if val else None, len(val), ckpt.name if ckpt else "-")


def sft_run(path: Path) -> RunInfo:
    history = json.loads((path / "sft_history.json").read_text())
    steps = max((r["step"] for r in history.get("history", [])), default=0)
    return RunInfo(path, "sft", str(steps), None, None, 0, f"this folder (step {history.get('best_step', '?')})")


def find_runs(folder: str | Path) -> list[RunInfo]:
    """Every run at or below `folder` (RL: metrics.jsonl; SFT: sft_history.json), sorted by path."""
    root = Path(folder)
    if not root.is_dir():
        raise FileNotFoundError(f"no such folder: {root}")
    found = []

    def visit(d: Path, depth: int) -> None:
        if (d / "metrics.jsonl").is_file():
            found.append(rl_run(d))
        elif (d / "sft_history.json").is_file():
            found.append(sft_run(d))
        if depth < MAX_DEPTH:
            for child in sorted(p for p in d.iterdir() if p.is_dir() and not p.name.startswith((".", "global_step_"))):
                visit(child, depth + 1)

    visit(root, 0)
    return found


def runs_table(folder: str | Path, runs: list[RunInfo]):
    from rich.table import Table

    table = Table(title=f"runs in {folder}")
    for name, justify in (("run", "left"), ("algorithm", "left"), ("steps", "right"), ("last reward", "right"),
                          ("val accuracy", "right"), ("checkpoint", "left")):
        table.add_column(name, justify=justify)
    root = Path(folder)
    for r in runs:
        acc = "-" if r.accuracy is None else f"{r.accuracy:.1%}" + (
            f" (mean of {r.accuracy_sources})" if r.accuracy_sources > 1 else "")
        table.add_row(str(r.path.relative_to(root)) if r.path != root else r.path.name or str(root), r.algorithm,
                      r.steps, "-" if r.reward is None else f"{r.reward:.3f}", acc, r.checkpoint)
    return table
