"""The loop acts on what the watch finds (trainer.watch.action / actions): `stop` before the update leaves the
flagged batch untrained, saves the step before and ends the command with exit code 1; `checkpoint` after
validation saves that step and trains on. A test detector that fires at a set step stands in for a real one (the
detectors themselves: tests/test_watch.py), so the run's outcome does not depend on what a random model samples.
Three short runs of the tiny model (about 40 s)."""

import json
from dataclasses import asdict
from types import SimpleNamespace

import pytest
import torch

from posttrain.watch import DETECTORS, Reading, Watch
from posttrain.watch.base import Detector

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    from posttrain.data.synthetic import write_task

    return write_task(tmp_path_factory.mktemp("watch_task") / "data", seed=0, operands=range(0, 10), held_out=8,
                      dev=4)


def overrides(model, files, run, steps=3, *extra):
    return ["algorithm.adv_estimator=grpo", "data.train_batch_size=4", "data.max_prompt_length=32",
            "data.max_response_length=4", "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
            "actor_rollout_ref.actor.optim.lr=3e-4", "actor_rollout_ref.model.enable_gradient_checkpointing=False",
            f"actor_rollout_ref.model.path={model}", f"data.train_files={files['rl_train']}",
            f"data.val_files={files['test']}", f"trainer.total_training_steps={steps}", "trainer.test_freq=1",
            f"trainer.default_local_dir={run}", "trainer.logger=['jsonl']", "reward_model.num_workers=0",
            *extra]


def trip_watch(monkeypatch, phase: str, at: int, action: str):
    """Watch.from_config builds a watch whose only detector, `test_trip`, reads 1 from step `at` on."""
    def fn(inp, history, s):
        return Reading(float(inp.step >= at), f"the test detector trips at step {at}", [0] if inp.view else [])

    monkeypatch.setitem(DETECTORS, "test_trip", Detector("test_trip", phase, fn, "trips at a set step"))

    def from_config(cfg, run_dir, *, max_length, writer):
        s = SimpleNamespace(**{**asdict(cfg.trainer.watch), **{name: None for name in DETECTORS}, "test_trip": 0.5,
                               "actions": {"test_trip": action}})
        return Watch(s, run_dir, max_length=max_length, writer=writer)

    monkeypatch.setattr(Watch, "from_config", staticmethod(from_config))


def lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_stop_before_the_update_saves_the_step_before_and_exits_1(tiny_model_dir, task, tmp_path, monkeypatch,
                                                                   capsys):
    from posttrain.cli import main

    trip_watch(monkeypatch, "batch", at=2, action="stop")
    run = tmp_path / "run"
    assert main(["train", *overrides(tiny_model_dir, task, run)]) == 1
    err = capsys.readouterr().err
    assert "[watch] step 2: test_trip fired (1 >= 0.5)" in err and "samples s2-" in err
    assert "the watch stopped the run at step 2" in err and "global_step_1" in err
    rows = lines(run / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert "actor/pg_loss" in rows[1] and "actor/pg_loss" not in rows[2]  # step 2's batch was not trained on
    assert rows[2]["watch/test_trip"] == 1.0
    assert sorted(p.name for p in run.glob("global_step_*")) == ["global_step_1"]
    extra = torch.load(run / "global_step_1" / "extra.pt", weights_only=True)
    assert extra["data_cursor"] == 1  # a resume draws step 2's prompts again
    finding, = lines(run / "watch" / "findings.jsonl")
    assert finding["step"] == 2 and finding["action"] == "stop" and finding["samples"][0]["response"] is not None
    assert finding["samples"][0]["prompt"].endswith("=") and "score" in finding["samples"][0]["reward"]


def test_checkpoint_after_validation_saves_that_step_and_trains_on(tiny_model_dir, task, tmp_path, monkeypatch):
    from posttrain.config import load_config
    from posttrain.trainer.rl import RLTrainer

    trip_watch(monkeypatch, "validation", at=2, action="checkpoint")
    run = tmp_path / "run"
    trainer = RLTrainer(load_config(None, overrides(tiny_model_dir, task, run)))
    trainer.fit()
    assert trainer.global_step == 3 and trainer.watch_stop is None
    assert sorted(p.name for p in run.glob("global_step_*")) == ["global_step_2"]
    assert [(f["step"], f["action"], f["samples"]) for f in lines(run / "watch" / "findings.jsonl")] == \
        [(2, "checkpoint", [])]  # validation has no batch rows to flag
    assert [r["step"] for r in lines(run / "metrics.jsonl")] == [0, 1, 2, 3]


def test_the_real_detectors_log_every_step_and_the_report_reads_the_folder(tiny_model_dir, task, tmp_path):
    from posttrain.config import load_config
    from posttrain.report import write_report
    from posttrain.trainer.rl import RLTrainer

    run = tmp_path / "run"
    RLTrainer(load_config(None, overrides(tiny_model_dir, task, run, 2, "trainer.watch.window=1"))).fit()
    rows = lines(run / "metrics.jsonl")
    batch_or_update = [d.name for d in DETECTORS.values() if d.phase != "validation"]
    for row in rows[1:]:
        assert {f"watch/{name}" for name in batch_or_update} <= set(row)
    assert "watch/val_divergence" in rows[-1]
    detectors = json.loads((run / "watch" / "detectors.json").read_text())["detectors"]
    assert set(detectors) == set(DETECTORS) and detectors["length_drift"]["action"] == "warn"
    html = write_report(run).read_text()
    assert all(f"id='{s}'" in html for s in ("summary", "curves", "detectors", "findings", "config"))
