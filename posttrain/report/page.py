"""The report page's HTML: one file with its style inline, no script, no external resource. Sections (their ids are
what the browser test checks): summary, curves, detectors, findings, config."""

from __future__ import annotations

import json
from html import escape

from .charts import CURVES, detector_chart, line_chart, series

SECTIONS = ("summary", "curves", "detectors", "findings", "config")
STYLE = """
body { font-family: system-ui, -apple-system, "Segoe UI", sans-serif; margin: 0 auto; max-width: 1400px;
       padding: 1em 2em; color: #1d2125; background: #fff; }
h1 { font-size: 1.6em; } h2 { border-bottom: 2px solid #d0d7de; padding-bottom: .2em; margin-top: 1.6em; }
nav a { margin-right: 1em; }
.grid { display: flex; flex-wrap: wrap; gap: 8px; } .grid svg { width: 640px; max-width: 100%; height: auto; }
table { border-collapse: collapse; margin: .6em 0; } td, th { border: 1px solid #d0d7de; padding: .25em .6em;
  text-align: left; vertical-align: top; } th { background: #f6f8fa; }
.fired { color: #b42318; font-weight: 600; } .quiet { color: #1a7f37; }
.finding { border: 1px solid #d0d7de; border-radius: 6px; padding: .6em 1em; margin: 1em 0; }
.sample { margin: .8em 0 .8em 1em; }
.msg { border-radius: 8px; padding: .4em .8em; margin: .3em 0; white-space: pre-wrap; font-family: ui-monospace,
  "SFMono-Regular", Menlo, monospace; font-size: .9em; max-width: 1100px; overflow-wrap: anywhere; }
.role { font-weight: 600; font-family: system-ui, sans-serif; display: block; margin-bottom: .2em; }
.user, .system { background: #eef4ff; } .assistant { background: #f0f7ef; } .tool { background: #fff6e5; }
.other { background: #f3f3f3; }
pre.config { background: #f6f8fa; padding: 1em; overflow: auto; max-height: 40em; }
"""


def _table(rows: list[list[str]], head: list[str]) -> str:
    """A table of already escaped cells."""
    return ("<table>" + ("<tr>" + "".join(f"<th>{h}</th>" for h in head) + "</tr>" if head else "")
            + "".join("<tr>" + "".join(f"<td>{c}</td>" for c in r) + "</tr>" for r in rows) + "</table>")


def _number(value) -> str:
    return f"{value:.4g}" if isinstance(value, (int, float)) else escape(str(value))


def summary_section(run_dir: str, rows: list[dict], config: dict, findings: list[dict]) -> str:
    alg = (config.get("algorithm") or {}).get("adv_estimator", "?")
    steps = max((r.get("step", 0) for r in rows), default=0)
    last = lambda key: next((r[key] for r in reversed(rows) if key in r), None)  # noqa: E731
    val = sorted({k for r in rows for k in r if k.startswith("val-core/")})
    facts = [["run folder", escape(str(run_dir))], ["algorithm", escape(str(alg))], ["steps logged", str(steps)],
             ["last training reward", _number(last("critic/score/mean"))]]
    facts += [[escape(k), _number(last(k))] for k in val]
    fired = sorted({f["detector"] for f in findings})
    facts.append(["detectors fired", f'<span class="fired">{escape(", ".join(fired))}</span>' if fired
                  else '<span class="quiet">none</span>'])
    return _table(facts, [])


def curves_section(rows: list[dict]) -> str:
    parts = []
    for heading, charts in CURVES:
        drawn = [line_chart(title, curves, ylabel, named=any(k.endswith("/") for k in keys))
                 for title, keys, ylabel in charts if (curves := series(rows, keys))]
        if drawn:
            parts.append(f"<h3>{escape(heading)}</h3><div class='grid'>{''.join(drawn)}</div>")
    return "".join(parts) or "<p>No curves: the run logged none of the standard metrics.</p>"


def detectors_section(rows: list[dict], detectors: dict, findings: list[dict]) -> str:
    names = list(detectors) + sorted({k.split("/")[1] for r in rows for k in r
                                      if k.startswith("watch/") and k.count("/") == 1} - set(detectors))
    if not names:
        return ("<p>This run has no detector records (<code>trainer.watch.enable</code> was off, or the run "
                "predates the watch).</p>")
    table, charts = [], []
    for name in names:
        info = detectors.get(name, {})
        threshold = info.get("threshold")
        fired = [f["step"] for f in findings if f["detector"] == name]
        x, y = series(rows, [f"watch/{name}"]).get(f"watch/{name}", ([], []))
        table.append([escape(name), escape(info.get("summary", "")), _number(threshold) if threshold is not None
                      else "off", escape(info.get("action", "")),
                      f'<span class="fired">{", ".join(map(str, fired))}</span>' if fired
                      else '<span class="quiet">never</span>'])
        if x:
            charts.append(detector_chart(name, x, y, threshold, fired))
    return (_table(table, ["detector", "watches for", "threshold", "action", "fired at steps"])
            + "<p>Each detector's value per step against its threshold (docs/reward_hacking.md defines them).</p>"
            + f"<div class='grid'>{''.join(charts)}</div>")


def _message(role: str, content) -> str:
    if not isinstance(content, str):
        content = json.dumps(content, ensure_ascii=False, indent=1)
    kind = role if role in ("user", "system", "assistant", "tool") else "other"
    return f"<div class='msg {kind}'><span class='role'>{escape(role)}</span>{escape(content)}</div>"


def conversation(sample: dict) -> str:
    """A flagged sample as a conversation: the prompt, then the response (or the episode's messages), then its
    reward and the reward's components."""
    if sample.get("messages"):
        body = "".join(_message(str(m.get("role", "?")), m.get("content", "")) for m in sample["messages"])
    else:
        body = _message("user", sample.get("prompt", "")) + _message("assistant", sample.get("response", ""))
    reward = sample.get("reward") or {}
    facts = [[escape(k), _number(v)] for k, v in reward.items()]
    facts += [["ground truth", escape(str(sample.get("ground_truth", "")))],
              ["response tokens", _number(sample.get("length", ""))]]
    return (f"<div class='sample'><b>{escape(str(sample.get('id', '')))}</b> "
            f"<small>{escape(str(sample.get('data_source', '')))}</small>{body}{_table(facts, ['reward', ''])}</div>")


def findings_section(findings: list[dict]) -> str:
    if not findings:
        return "<p class='quiet'>No detector fired in this run.</p>"
    out = []
    for f in sorted(findings, key=lambda f: f.get("step", 0)):
        samples = "".join(conversation(s) for s in f.get("samples", [])) or "<p>No samples for this detector.</p>"
        out.append(f"<div class='finding' id='finding-{escape(str(f['detector']))}-{f['step']}'>"
                   f"<h3>Step {f['step']}: {escape(str(f['detector']))} "
                   f"<span class='fired'>{_number(f['value'])} &ge; {_number(f['threshold'])}</span> "
                   f"<small>({escape(str(f.get('action', '')))})</small></h3><p>{escape(str(f.get('note', '')))}</p>"
                   f"{samples}</div>")
    return "".join(out)


def page(title: str, sections: dict[str, tuple[str, str]]) -> str:
    """The whole document; `sections` maps an id to (heading, inner HTML)."""
    nav = "".join(f"<a href='#{sid}'>{escape(head)}</a>" for sid, (head, _) in sections.items())
    body = "".join(f"<section id='{sid}'><h2>{escape(head)}</h2>{html}</section>"
                   for sid, (head, html) in sections.items())
    return (f"<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'><title>{escape(title)}</title>"
            f"<meta name='viewport' content='width=device-width, initial-scale=1'><style>{STYLE}</style></head>"
            f"<body><h1>{escape(title)}</h1><nav>{nav}</nav>{body}</body></html>")
