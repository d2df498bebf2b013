"""`posttrain report RUN_DIR`: one self-contained HTML page of a run, read from its folder only (metrics.jsonl,
config.yaml, watch/detectors.json and watch/findings.jsonl), never from a live trainer: the run's curves, the
reward-hacking detectors against their thresholds, the samples they flagged as conversations, and the config."""

from __future__ import annotations

import json
from pathlib import Path

from ..watch import DETECTORS
from .page import conversation, curves_section, detectors_section, findings_section, page, summary_section

__all__ = ["conversation", "read_run", "write_report"]


def _json_lines(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    out = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:  # a line cut short by a killed run
            continue
        if isinstance(row, dict):
            out.append(row)
    return out


def read_run(run_dir: str | Path) -> dict:
    """What the page shows, from the run folder: rows (metric lines), config (dict and text), detectors, findings.
    FileNotFoundError when the folder holds no metrics.jsonl."""
    import yaml

    run = Path(run_dir)
    if not (run / "metrics.jsonl").is_file():
        raise FileNotFoundError(f"{run} is not a run folder (no metrics.jsonl in it)")
    config_text = (run / "config.yaml").read_text() if (run / "config.yaml").is_file() else ""
    try:
        config = yaml.safe_load(config_text) or {}
    except yaml.YAMLError:
        config = {}
    watch = run / "watch"
    detectors = {}
    if (watch / "detectors.json").is_file():
        detectors = json.loads((watch / "detectors.json").read_text()).get("detectors", {})
    elif isinstance(config.get("trainer"), dict) and isinstance(config["trainer"].get("watch"), dict):
        w = config["trainer"]["watch"]  # a run folder without detectors.json: the thresholds its config gave
        detectors = {k: {"threshold": v, "summary": DETECTORS[k].summary} for k, v in w.items()
                     if isinstance(v, (int, float)) and k in DETECTORS}
    return {"rows": _json_lines(run / "metrics.jsonl"), "config": config if isinstance(config, dict) else {},
            "config_text": config_text, "detectors": detectors, "findings": _json_lines(watch / "findings.jsonl")}


def write_report(run_dir: str | Path, output: str | Path | None = None) -> Path:
    """Write the page (default RUN_DIR/report.html) and return its path."""
    from html import escape

    run = read_run(run_dir)
    path = Path(output) if output else Path(run_dir) / "report.html"
    config_html = (f"<pre class='config'>{escape(run['config_text'])}</pre>" if run["config_text"]
                   else "<p>No config.yaml in the run folder.</p>")
    sections = {
        "summary": ("Summary", summary_section(str(run_dir), run["rows"], run["config"], run["findings"])),
        "curves": ("Curves", curves_section(run["rows"])),
        "detectors": ("Reward-hacking detectors", detectors_section(run["rows"], run["detectors"], run["findings"])),
        "findings": ("Flagged samples", findings_section(run["findings"])),
        "config": ("Config", config_html),
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(page(f"posttrain run: {Path(run_dir).resolve().name}", sections), encoding="utf-8")
    return path
