"""`Watch`: runs the detectors beside the loop, keeps the run's history, and turns readings into findings.

The loop calls `batch` on the scored batch before the update, `update` after it and `validation` after a
validation; each returns the `watch/*` metrics and the findings of that phase. A detector *fires* when its value
reaches its threshold at a step where it was below it the step before (or had no value): a detector that stays
above says so once, and again after it went below. Every rank computes the same readings from the same batch; only
rank 0 (`writer=True`) prints the warning lines and writes RUN_DIR/watch/ (detectors.json: what ran with which
thresholds and actions; findings.jsonl: one line per firing, with its flagged samples)."""

from __future__ import annotations

import json
import sys
from dataclasses import asdict, dataclass, field, is_dataclass
from pathlib import Path

from .base import BATCH, UPDATE, VALIDATION, StepInput
from .history import History
from .registry import DETECTORS
from .view import StepView, step_view

FOLDER = "watch"


@dataclass
class Finding:
    detector: str
    step: int
    value: float
    threshold: float
    action: str
    note: str
    sample_ids: list[str] = field(default_factory=list)
    samples: list[dict] = field(default_factory=list)

    def line(self, where: Path | None = None) -> str:
        """The one warning line: detector, step, value against threshold, what moved, example sample ids."""
        ids = f"; samples {', '.join(self.sample_ids)}" if self.sample_ids else ""
        return (f"[watch] step {self.step}: {self.detector} fired ({self.value:.3g} >= {self.threshold:g}): "
                f"{self.note}{ids}" + (f" ({where})" if where else ""))


def sample_record(view: StepView, row: int) -> dict:
    """A flagged sample as the report shows it: prompt, the response or the episode's messages, reward and its
    components."""
    x = view.samples[row]
    record = {"id": view.sample_id(row), "data_source": x.data_source, "ground_truth": x.ground_truth,
              "prompt": x.prompt, "reward": {"score": x.score, "acc": x.acc, **x.components}, "length": x.length}
    if x.messages is not None:
        record["messages"] = x.messages
    else:
        record["response"] = x.response
    return record


class Watch:
    def __init__(self, settings, run_dir: str | Path, *, max_length: int, writer: bool = True,
                 history: History | None = None):
        self.s, self.run_dir, self.max_length, self.writer = settings, Path(run_dir), max_length, writer
        self.history = history or History()
        self.view: StepView | None = None  # the current step's batch, read once, shared by its phases
        self.detectors = [d for name, d in DETECTORS.items() if getattr(settings, name, None) is not None]

    @classmethod
    def from_config(cls, cfg, run_dir, *, max_length: int, writer: bool) -> "Watch | None":
        s = cfg.trainer.watch
        return cls(s, run_dir, max_length=max_length, writer=writer) if s.enable else None

    def action_of(self, name: str) -> str:
        return self.s.actions.get(name, self.s.action)

    @property
    def folder(self) -> Path:
        return self.run_dir / FOLDER

    def start(self, resumed_step: int = 0, checkpoint: Path | None = None) -> None:
        """Before the first step: the history of a resumed run from its metrics.jsonl (steps up to the checkpoint;
        a run resumed from another run's `checkpoint` has none of its own: that run's, beside the checkpoint), its
        findings past the checkpoint dropped (they will be found again), and detectors.json written."""
        if resumed_step > 0:
            rows = _read_lines(self.run_dir / "metrics.jsonl", resumed_step)
            if not rows and checkpoint is not None:
                rows = _read_lines(Path(checkpoint).parent / "metrics.jsonl", resumed_step)
            self.history = History(rows)
        if not self.writer:
            return
        self.folder.mkdir(parents=True, exist_ok=True)
        kept = _read_lines(self.folder / "findings.jsonl", resumed_step) if resumed_step > 0 else []
        _write_lines(self.folder / "findings.jsonl", kept)
        detectors = {d.name: {"phase": d.phase, "summary": d.summary, "threshold": getattr(self.s, d.name),
                              "action": self.action_of(d.name)} for d in self.detectors}
        settings = {k: v for k, v in (asdict(self.s) if is_dataclass(self.s) else vars(self.s)).items()
                    if k not in DETECTORS}
        (self.folder / "detectors.json").write_text(json.dumps({"detectors": detectors, "settings": settings},
                                                               indent=1))

    def record(self, step: int, metrics: dict) -> None:
        """The step's logged metrics join the history (call it where the tracker logs them)."""
        self.history.add(step, dict(metrics))

    # ------------------------------------------------------------------ the three phases

    def batch(self, batch, step: int) -> tuple[dict, list[Finding]]:
        self.view = step_view(batch, step, self.max_length)
        return self._run(BATCH, StepInput(step, self.view))

    def update(self, batch, step: int, metrics: dict) -> tuple[dict, list[Finding]]:
        tensors = {k: batch[k] for k in ("old_log_probs", "ref_log_probs", "rollout_log_probs", "response_mask")
                   if k in batch}
        return self._run(UPDATE, StepInput(step, self.view, metrics, tensors))

    def validation(self, step: int, metrics: dict) -> tuple[dict, list[Finding]]:
        return self._run(VALIDATION, StepInput(step, None, metrics))

    def _run(self, phase: str, inp: StepInput) -> tuple[dict, list[Finding]]:
        metrics, findings = {}, []
        for d in self.detectors:
            if d.phase != phase:
                continue
            reading = d.fn(inp, self.history, self.s)
            key = f"watch/{d.name}"
            metrics[key] = reading.value
            metrics |= {f"watch/parts/{d.name}/{part}": v for part, v in reading.parts.items() if v is not None}
            threshold, before = getattr(self.s, d.name), self.history.last(key)
            if reading.value >= threshold and (before is None or before < threshold):
                view = inp.view
                rows = reading.rows[: self.s.samples] if view is not None else []
                findings.append(Finding(d.name, inp.step, reading.value, threshold, self.action_of(d.name),
                                        reading.note, [view.sample_id(r) for r in rows],
                                        [sample_record(view, r) for r in rows]))
        if findings and self.writer:
            self._report(findings)
        return metrics, findings

    def _report(self, findings: list[Finding]) -> None:
        path = self.folder / "findings.jsonl"
        self.folder.mkdir(parents=True, exist_ok=True)
        with path.open("a", encoding="utf-8") as f:
            for finding in findings:
                f.write(json.dumps(asdict(finding), ensure_ascii=False, default=str) + "\n")
        for finding in findings:
            print(finding.line(path), file=sys.stderr, flush=True)


def _read_lines(path: Path, up_to_step: int) -> list[dict]:
    """The JSON lines of `path` with step <= `up_to_step` (a line cut short is skipped; no file: none)."""
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(row, dict) and row.get("step", 0) <= up_to_step:
            rows.append(row)
    return rows


def _write_lines(path: Path, rows: list[dict]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(json.dumps(r, ensure_ascii=False, default=str) + "\n" for r in rows))
    tmp.replace(path)


class WatchStopped(RuntimeError):
    """A detector whose action is `stop` fired: the run ended after saving the weights it judged."""
