"""`posttrain report RUN_DIR`: one HTML file that needs nothing else (no script, no link, no network), with the run's
curves, the detectors against their thresholds, the flagged samples as conversations and the config; rendered by a
real browser (headless Chromium) where one is installed."""

import json
import re
import shutil
import subprocess

import pytest

from posttrain.report import write_report
from posttrain.report.page import SECTIONS, curves_section

BROWSER = next((b for b in ("chromium", "chromium-browser", "google-chrome") if shutil.which(b)), None)
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A run folder as the trainer leaves it: 12 steps of metrics, validation every 4, a fired detector with a
    single-turn sample and an episode."""
    run = tmp_path_factory.mktemp("report") / "run"
    run.mkdir()
    rows = [{"step": 0, "val-core/synthetic/arithmetic/acc/mean@1": 0.3}]
    for t in range(1, 13):
        row = {"step": t, "critic/score/mean": 0.2 + 0.05 * t, "reward/format/mean": 0.1 * t,
               "response_length/mean": 4 + t, "response_length/clip_ratio": t / 12, "actor/kl_loss": 0.001 * t,
               "actor/entropy": 1.0 - 0.05 * t, "actor/pg_clipfrac": 0.01, "agent/tool_calls/mean": 1 + t / 4,
               "watch/length_drift": 0.1 * t, "watch/reward_components": 0.05 * t, "watch/kl_spike": 1.0}
        if t % 4 == 0:
            row["val-core/synthetic/arithmetic/acc/mean@1"] = 0.3 - 0.02 * t
            row["watch/val_divergence"] = 0.02 * t
        rows.append(row)
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 13, "cut')
    (run / "config.yaml").write_text("algorithm:\n  adv_estimator: grpo\ntrainer:\n  watch:\n    length_drift: 0.5\n")
    (run / "watch").mkdir()
    detectors = {name: {"phase": "batch", "summary": f"what {name} watches", "threshold": threshold, "action": "warn"}
                 for name, threshold in (("length_drift", 0.5), ("reward_components", 0.2), ("kl_spike", 5.0),
                                         ("val_divergence", 0.05))}
    (run / "watch" / "detectors.json").write_text(json.dumps({"detectors": detectors, "settings": {"window": 5}}))
    findings = [
        {"detector": "length_drift", "step": 5, "value": 0.5, "threshold": 0.5, "action": "warn",
         "note": "mean response length 4.0 -> 9.0 tokens", "sample_ids": ["s5-0:0"],
         "samples": [{"id": "s5-0:0", "data_source": "synthetic/arithmetic", "ground_truth": "82",
                      "prompt": "37+45=", "response": "#### 8222 <b>not bold</b>",
                      "reward": {"score": 1.0, "acc": 0.0}, "length": 8}]},
        {"detector": "val_divergence", "step": 8, "value": 0.16, "threshold": 0.05, "action": "checkpoint",
         "note": "training reward up while validation fell", "sample_ids": [], "samples": []},
        {"detector": "reward_components", "step": 6, "value": 0.3, "threshold": 0.2, "action": "warn",
         "note": "reward component 'format' 0.1 -> 0.4", "sample_ids": ["s6-1:2"],
         "samples": [{"id": "s6-1:2", "data_source": "tools", "ground_truth": "42", "prompt": "6*7=",
                      "messages": [{"role": "user", "content": "6*7="},
                                   {"role": "assistant", "content": '<tool_call>{"name": "calculator"}</tool_call>'},
                                   {"role": "tool", "content": "42"}, {"role": "assistant", "content": "42"}],
                      "reward": {"score": 1.3, "acc": 1.0, "format": 1.0}, "length": 30}]},
    ]
    (run / "watch" / "findings.jsonl").write_text("".join(json.dumps(f) + "\n" for f in findings))
    return run


def test_the_page_holds_every_section_and_needs_nothing_else(run_dir, tmp_path):
    html = write_report(run_dir, tmp_path / "page.html").read_text()
    assert all(f"<section id='{s}'>" in html for s in SECTIONS)
    names = re.sub(r'xmlns(:\w+)?="[^"]*"', "", html)  # SVG's namespaces are names, not addresses to fetch
    for outside in ("<script", "<link", "src=", "http:", "https:", "@import", "<img"):
        assert outside not in names, outside
    assert not re.search(r"url\((?!#)", html)  # only references within the page (clip paths)
    assert html.count("<svg") >= 10  # 8 curves (reward, components, validation, 2 lengths, KL, entropy, clip,
    # tool calls: 9) and the detector charts
    assert "&lt;b&gt;not bold&lt;/b&gt;" in html and "<b>not bold</b>" not in html  # samples are text, not markup
    assert "&lt;tool_call&gt;" in html and "class='msg tool'" in html  # the episode as a conversation
    assert "adv_estimator: grpo" in html  # the config
    assert "threshold 0.5" in html and "length_drift" in html


def test_the_report_command(run_dir, tmp_path, capsys):
    from posttrain.cli import main

    assert main(["report", str(run_dir), "-o", str(tmp_path / "r.html")]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "r.html")
    assert main(["report", str(tmp_path)]) == 1
    assert "not a run folder (no metrics.jsonl" in capsys.readouterr().err


def test_a_run_without_watch_records_still_reports(tmp_path):
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "critic/score/mean": 0.5}) + "\n")
    html = write_report(tmp_path).read_text()
    assert "no detector records" in html and "No detector fired" in html and "No config.yaml" in html



def test_a_single_reward_component_is_named():
    """A chart of every metric under a prefix names its curve even when there is one (the demo's scorer logs only
    `reward/acc/mean`: without a legend its chart looked like the training reward's twin); a chart of one named
    metric needs none."""
    from posttrain.report.charts import line_chart

    one = {"reward/acc/mean": ([1, 2, 3], [0.1, 0.4, 0.5])}
    assert ">acc<" in line_chart("Reward components", one, "value", named=True)
    assert ">acc<" not in line_chart("Reward components", one, "value")
    rows = [{"step": t, "critic/score/mean": 0.1 * t, "reward/acc/mean": 0.1 * t} for t in range(1, 4)]
    page = curves_section(rows)
    components = page[page.index("Reward components"):]
    assert ">acc<" in components[:components.index("</svg>")]

@pytest.mark.skipif(BROWSER is None, reason="no Chromium installed (Debian: apt-get install chromium; install.sh "
                                            "does it where it can): the page was not rendered in a browser")
def test_a_real_browser_renders_every_section(run_dir, tmp_path):
    from PIL import Image, ImageStat

    page = write_report(run_dir, tmp_path / "page.html")
    common = [BROWSER, *FLAGS, f"--user-data-dir={tmp_path / 'profile'}", "--window-size=1400,3000"]
    dom = subprocess.run([*common, "--dump-dom", page.as_uri()], capture_output=True, text=True, timeout=120).stdout
    for section in SECTIONS:
        assert f'<section id="{section}">' in dom, section
    assert dom.count("<svg") >= 10 and "finding-length_drift-5" in dom
    shot = tmp_path / "shot.png"
    subprocess.run([*common, f"--screenshot={shot}", page.as_uri()], capture_output=True, timeout=120, check=True)
    image = Image.open(shot).convert("RGB")
    assert image.size == (1400, 3000)
    colours = image.getcolors(maxcolors=1 << 16)
    assert colours is None or len(colours) > 50  # text, charts and coloured boxes, not one blank colour
    assert max(ImageStat.Stat(image).stddev) > 20
