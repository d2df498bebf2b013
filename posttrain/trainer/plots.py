"""`posttrain plot RUN_DIR [RUN_DIR...]`: PNG charts of the standard metrics from each run's metrics.jsonl, the runs
overlaid with a legend — one PNG per metric and an overview grid of them all. A metric no run logged is skipped."""

from __future__ import annotations

import json
from pathlib import Path

# (file name, title, metric key or "val-core/" for every validation accuracy, y label)
STANDARD = (
    ("reward", "Training reward (mean score per response)", "critic/score/mean", "score"),
    ("val_accuracy", "Validation accuracy", "val-core/", "accuracy"),
    ("response_length", "Response length (mean)", "response_length/mean", "tokens"),
    ("entropy", "Policy entropy", "actor/entropy", "nats per token"),
    ("kl_loss", "KL to the reference (loss term)", "actor/kl_loss", "KL"),
    ("pg_loss", "Policy-gradient loss", "actor/pg_loss", "loss"),
    ("pg_clipfrac", "PPO clip fraction", "actor/pg_clipfrac", "fraction of tokens"),
    ("grad_norm", "Actor gradient norm", "actor/grad_norm", "norm"),
    ("vf_loss", "Critic value loss", "critic/vf_loss", "loss"),
    ("zero_std_groups", "Groups with no learning signal (all scores equal)", "batch/zero_std_group_frac", "fraction"),
    ("step_time", "Time per step", "timing_s/step", "seconds"),
)


def read_metrics(run_dir: Path) -> list[dict]:
    """The run's metric lines; a line cut short by a killed run is skipped."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{run_dir} is not a run folder (no metrics.jsonl in it)")
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


def run_labels(run_dirs: list[Path]) -> list[str]:
    """The shortest trailing path parts that tell the runs apart (`rl`, or `a/rl` and `b/rl`)."""
    parts = [Path(d).resolve().parts for d in run_dirs]
    for depth in range(1, max(len(p) for p in parts) + 1):
        labels = ["/".join(p[-depth:]) for p in parts]
        if len(set(labels)) == len(labels):
            return labels
    return [str(d) for d in run_dirs]


def series(rows: list[dict], key: str) -> dict[str, tuple[list, list]]:
    """{curve name: (steps, values)}: one curve for a plain key; one per validation metric for "val-core/"."""
    keys = sorted({k for r in rows for k in r if k.startswith(key)}) if key.endswith("/") else [key]
    out = {}
    for k in keys:
        points = [(r["step"], r[k]) for r in rows if k in r]
        if points:
            out[k] = ([p[0] for p in points], [p[1] for p in points])
    return out


def _curve_label(run: str, key: str, many_keys: bool) -> str:
    if not many_keys:
        return run
    short = key.removeprefix("val-core/").replace("/acc/", " ")
    return f"{run}: {short}"


def _draw(ax, title: str, key: str, ylabel: str, runs: list[tuple[str, list[dict]]]) -> bool:
    from matplotlib.ticker import MaxNLocator

    drawn = False
    curves = [(label, name, xy) for label, rows in runs for name, xy in series(rows, key).items()]
    names = {name for _, name, _ in curves}
    many = len(names) > 1
    if key.endswith("/") and len(names) == 1:  # the one validation metric: say which in the title
        title = f"{title}: {_curve_label('', names.pop(), True).removeprefix(': ')}"
    for label, name, (x, y) in curves:
        sparse = len(x) <= 20 or key.endswith("/")
        ax.plot(x, y, marker="o" if sparse else None, markersize=4, linewidth=1.6,
                label=_curve_label(label, name, many))
        drawn = True
    ax.set_title(title, fontsize=11)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("training step")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    if key in ("val-core/", "critic/score/mean", "batch/zero_std_group_frac"):
        low, high = ax.get_ylim()
        ax.set_ylim(min(low, 0.0), max(high, 1.0) if key != "critic/score/mean" else high)
    if drawn:
        ax.legend(fontsize=8, loc="best")
    return drawn


def plot_runs(run_dirs: list[str | Path], out_dir: str | Path) -> list[Path]:
    """Write `<name>.png` for every standard metric some run logged, and `overview.png`; returns the paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dirs = [Path(d) for d in run_dirs]
    runs = list(zip(run_labels(dirs), [read_metrics(d) for d in dirs]))
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written, present = [], []
    for name, title, key, ylabel in STANDARD:
        if not any(series(rows, key) for _, rows in runs):
            continue
        present.append((title, key, ylabel))
        fig, ax = plt.subplots(figsize=(7, 4.2))
        _draw(ax, title, key, ylabel, runs)
        fig.tight_layout()
        fig.savefig(out / f"{name}.png", dpi=110)
        plt.close(fig)
        written.append(out / f"{name}.png")
    if present:
        cols = 2 if len(present) > 1 else 1
        rows = (len(present) + cols - 1) // cols
        fig, axes = plt.subplots(rows, cols, figsize=(7 * cols, 3.8 * rows), squeeze=False)
        for ax, (title, key, ylabel) in zip(axes.flat, present):
            _draw(ax, title, key, ylabel, runs)
        for ax in list(axes.flat)[len(present):]:
            ax.axis("off")
        fig.suptitle("posttrain runs: " + ", ".join(label for label, _ in runs), fontsize=13)
        fig.tight_layout(rect=(0, 0, 1, 0.97))
        fig.savefig(out / "overview.png", dpi=90)
        plt.close(fig)
        written.append(out / "overview.png")
    return written
