"""The report's charts: matplotlib figures written as inline SVG (text kept as text, no script, no external file).

matplotlib is already a dependency (`posttrain plot`); a static SVG needs nothing at view time, so the page opens
offline in any browser and stays small (tens of kB a chart)."""

from __future__ import annotations

import io
import re

# (section heading, [(title, [metric key or prefix ending in "/"], y label)]): the run's curves; a chart none of
# whose keys the run logged is left out
CURVES = (
    ("Reward", [("Training reward (mean score per response)", ["critic/score/mean"], "score"),
                ("Reward components (the scorer's extra keys, mean)", ["reward/"], "value")]),
    ("Validation", [("Held-out validation", ["val-core/"], "accuracy")]),
    ("Lengths", [("Response length (mean, tokens)", ["response_length/mean"], "tokens"),
                 ("Share of responses at the length limit", ["response_length/clip_ratio"], "share")]),
    ("KL and entropy", [("KL", ["actor/kl_loss", "actor/ppo_kl", "actor/reward_kl_penalty"], "KL"),
                        ("Policy entropy", ["actor/entropy"], "nats per token"),
                        ("PPO clip fraction", ["actor/pg_clipfrac"], "share of tokens")]),
    ("Staleness and mismatch", [("Staleness (asynchronous RL)", ["async/staleness_mean", "async/staleness_max"],
                                 "versions"),
                                ("Rollout vs trainer probabilities", ["training/rollout_probs_diff_mean",
                                                                      "training/rollout_probs_diff_max"], "|p - p'|")]),
    ("Tool calls", [("Tool calls and turns per episode", ["agent/tool_calls/mean", "agent/turns/mean"], "per episode"),
                    ("Tool errors", ["agent/tool_errors"], "per step")]),
)
_SKIP_REWARD = ("reward/errors", "reward/timeouts")


def series(rows: list[dict], keys: list[str]) -> dict[str, tuple[list, list]]:
    """{metric: (steps, values)} for each key (a key ending in "/" stands for every metric below it)."""
    names: list[str] = []
    for key in keys:
        found = sorted({k for r in rows for k in r if k.startswith(key)}) if key.endswith("/") else [key]
        names += [k for k in found if k not in names and not k.startswith(_SKIP_REWARD)]
    out = {}
    for name in names:
        points = [(r["step"], r[name]) for r in rows if isinstance(r.get(name), (int, float)) and "step" in r]
        if points:
            out[name] = ([p[0] for p in points], [p[1] for p in points])
    return out


def _svg(fig) -> str:
    """The figure as an <svg> element (no XML prolog or doctype)."""
    buf = io.StringIO()
    fig.savefig(buf, format="svg")
    text = buf.getvalue()
    return re.sub(r"\s*<metadata>.*?</metadata>", "", text[text.index("<svg"):], flags=re.DOTALL)


def _figure():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.rcParams["svg.fonttype"] = "none"  # text stays text: smaller, and searchable in the page
    fig, ax = plt.subplots(figsize=(6.4, 3.4))
    return plt, fig, ax


def _finish(plt, fig, ax, title: str, ylabel: str, legend: bool) -> str:
    from matplotlib.ticker import MaxNLocator

    ax.set_title(title, fontsize=11)
    ax.set_xlabel("training step")
    ax.set_ylabel(ylabel)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(alpha=0.3)
    if legend:
        ax.legend(fontsize=8, loc="best")
    fig.tight_layout()
    svg = _svg(fig)
    plt.close(fig)
    return svg


def _label(name: str) -> str:
    return re.sub(r"^(val-core/|reward/)", "", name).replace("/acc/", " ").removesuffix("/mean")


def line_chart(title: str, curves: dict[str, tuple[list, list]], ylabel: str, named: bool = False) -> str:
    """One line per curve; a legend where there are several, or where `named` (a chart of every metric under a
    prefix: its one curve's name, e.g. the reward component `acc`, is not in the title)."""
    plt, fig, ax = _figure()
    for name, (x, y) in curves.items():
        ax.plot(x, y, marker="o" if len(x) <= 20 else None, markersize=3, linewidth=1.5, label=_label(name))
    return _finish(plt, fig, ax, title, ylabel, legend=len(curves) > 1 or named)


def detector_chart(name: str, steps: list, values: list, threshold: float | None, fired: list[int]) -> str:
    """A detector's value per step, its threshold as a dashed line and the steps it fired at as red marks."""
    plt, fig, ax = _figure()
    ax.plot(steps, values, linewidth=1.5, marker="o" if len(steps) <= 20 else None, markersize=3, label=f"watch/{name}")
    if threshold is not None:
        ax.axhline(threshold, color="tab:red", linestyle="--", linewidth=1, label=f"threshold {threshold:g}")
    at = dict(zip(steps, values))
    marks = [s for s in fired if s in at]
    if marks:
        ax.plot(marks, [at[s] for s in marks], "v", color="tab:red", markersize=9, label="fired")
    return _finish(plt, fig, ax, name, "value", legend=True)
