"""Every `trainer.logger` sink written by a real run and read back with its own reader: the same metric names and
values in metrics.jsonl, tensorboard, wandb (offline run files) and mlflow (a local file store), and the console's
lines. Plus the progress display's plain-text form, which is what CI and Slurm logs show."""

import json
import re
import struct
from pathlib import Path

import pytest

from posttrain.progress import ProgressBar
from posttrain.trainer.tracking import mlflow_name

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning", "ignore::FutureWarning")


def jsonl_rows(run: Path) -> dict[int, dict]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {r.pop("step"): r for r in rows}


def test_jsonl_has_every_step_and_the_standard_names(finished_run):
    rows = jsonl_rows(finished_run["run"])
    assert sorted(rows) == [0, 1, 2, 3]  # validation before training, then three steps
    assert set(rows[0]) == {"val-core/synthetic/arithmetic/acc/mean@1", "val-aux/synthetic/arithmetic/acc/pass@1"}
    for step in (1, 2, 3):
        assert {"critic/score/mean", "actor/pg_loss", "actor/entropy", "response_length/mean", "timing_s/step",
                "val-core/synthetic/arithmetic/acc/mean@1"} <= set(rows[step])


def test_tensorboard_holds_the_same_scalars(finished_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    rows = jsonl_rows(finished_run["run"])
    events = EventAccumulator(str(finished_run["run"] / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    assert set(events.Tags()["scalars"]) == {k for r in rows.values() for k in r}
    for tag in events.Tags()["scalars"]:
        logged = {e.step: e.value for e in events.Scalars(tag)}
        assert logged == pytest.approx({s: r[tag] for s, r in rows.items() if tag in r}, rel=1e-6, abs=1e-7), tag


def wandb_records(path: Path):
    """The records of a wandb run file (`run-<id>.wandb`): W&B's LevelDB-style log — a 7-byte header (":W&B",
    magic 0xBEE1, version), then 32 KiB blocks of chunks, each with a checksum, a length and a type (full, first,
    middle, last) — each record a wandb_internal_pb2.Record."""
    from wandb.proto import wandb_internal_pb2

    data, block = path.read_bytes(), 32 * 1024
    ident, magic, _ = struct.unpack("<4sHB", data[:7])
    assert ident == b":W&B" and magic == 0xBEE1
    pos, parts = 7, b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # a block's tail too short for a chunk header is padding
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if length == 0 and kind == 0:
            pos += left
            continue
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        parts = chunk if kind in (1, 2) else parts + chunk
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(parts)
            yield record


def test_wandb_offline_run_holds_the_same_history(finished_run):
    files = list((finished_run["run"] / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(files) == 1, files
    history, names = {}, set()
    for record in wandb_records(files[0]):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            names.add((record.run.project, record.run.display_name))
        if kind == "history":
            item = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item}
            history[item.pop("_step")] = {k: v for k, v in item.items() if not k.startswith("_")}
    assert names == {(finished_run["project"], finished_run["experiment"])}
    rows = jsonl_rows(finished_run["run"])
    assert sorted(history) == sorted(rows)
    for step, row in rows.items():
        assert history[step] == pytest.approx(row), step


def run_config(run: Path) -> dict:
    """The config the run wrote to its folder (config.yaml), as nested plain values."""
    import yaml

    return yaml.safe_load((run / "config.yaml").read_text())


def test_wandb_offline_run_holds_the_run_config(finished_run):
    """The hyperparameters reach wandb: its run record's config is the run's config, section by section."""
    [path] = (finished_run["run"] / "wandb").glob("offline-run-*/run-*.wandb")
    config = {}
    for record in wandb_records(path):
        if record.WhichOneof("record_type") == "run":
            config |= {i.key: json.loads(i.value_json) for i in record.run.config.update if i.key != "_wandb"}
        if record.WhichOneof("record_type") == "config":
            config |= {i.key: json.loads(i.value_json) for i in record.config.update if i.key != "_wandb"}
    assert config == run_config(finished_run["run"])
    assert config["actor_rollout_ref"]["actor"]["optim"]["lr"] == 3e-4 and config["data"]["train_batch_size"] == 8


def test_mlflow_run_holds_the_run_config_as_params(finished_run, monkeypatch):
    """The hyperparameters reach mlflow as params with dotted keys, one per config key."""
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    client = MlflowClient(finished_run["mlflow_uri"])
    [run] = client.search_runs([client.get_experiment_by_name(finished_run["project"]).experiment_id])
    params = run.data.params
    assert params["actor_rollout_ref.actor.optim.lr"] == "0.0003" and params["data.train_batch_size"] == "8"
    assert params["algorithm.adv_estimator"] == "grpo" and params["trainer.experiment_name"] == "finished"
    leaves, todo = {}, [("", run_config(finished_run["run"]))]
    while todo:
        prefix, section = todo.pop()
        for key, value in section.items():
            if isinstance(value, dict) and value:
                todo.append((f"{prefix}{key}.", value))
            else:
                leaves[f"{prefix}{key}"] = value
    assert set(params) == set(leaves)
    assert all(params[k] == str(v) for k, v in leaves.items()), [(k, params[k], v) for k, v in leaves.items()
                                                                 if params[k] != str(v)][:5]


def test_mlflow_file_store_holds_the_same_metrics(finished_run, monkeypatch):
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    client = MlflowClient(finished_run["mlflow_uri"])
    experiment = client.get_experiment_by_name(finished_run["project"])
    [run] = client.search_runs([experiment.experiment_id])
    assert run.info.run_name == finished_run["experiment"] and run.info.status == "FINISHED"
    rows = jsonl_rows(finished_run["run"])
    names = {k for r in rows.values() for k in r}
    assert set(run.data.metrics) == {mlflow_name(k) for k in names}
    assert "val-core/synthetic/arithmetic/acc/mean_at_1" in run.data.metrics  # mlflow refuses "@"
    for key in names:
        logged = {m.step: m.value for m in client.get_metric_history(run.info.run_id, mlflow_name(key))}
        assert logged == pytest.approx({s: r[key] for s, r in rows.items() if key in r}), key


def test_console_prints_each_step_and_the_progress_with_eta(finished_run):
    text, rows = finished_run["console"], jsonl_rows(finished_run["run"])
    assert "\x1b[" not in text  # a log file, not a terminal: no escape codes
    for step in (1, 2, 3):
        line = next(l for l in text.splitlines() if l.startswith(f"step {step:>4} "))
        val = "val-core/synthetic/arithmetic/acc/mean@1"
        assert f"{val}={rows[step][val]:.4g}" in line and f"score/mean={rows[step]['critic/score/mean']:.4g}" in line
    progress = [l for l in text.splitlines() if l.startswith("step ") and "eta" in l]
    assert [l.split()[1] for l in progress] == ["1/3", "2/3", "3/3"]
    assert re.fullmatch(r"step 3/3 \(100%\) elapsed \d+:\d\d:\d\d eta 0:00:00", progress[-1]), progress[-1]


def test_mlflow_store_that_cannot_open_is_one_config_error(tmp_path, monkeypatch):
    from posttrain.config import ConfigError
    from posttrain.trainer.tracking import Tracker

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"file:{tmp_path / 'mlruns'}")
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    with pytest.raises(ConfigError, match="trainer.logger=mlflow: mlflow could not open its tracking store.*"
                                          "MLFLOW_ALLOW_FILE_STORE=true"):
        Tracker(["mlflow"], tmp_path / "run", 1)


# ------------------------------------------------------------------ the progress display in a log


def test_plain_progress_lines_every_tenth_with_eta(capsys):
    with ProgressBar("work", 20, unit="items") as bar:
        for i in range(20):
            bar.advance()
            if i == 4:
                bar.print("a line of [output]")
    lines = capsys.readouterr().out.splitlines()
    progress = [l for l in lines if l.startswith("work ")]
    assert [l.split()[1] for l in progress] == [f"{2 * k}/20" for k in range(1, 11)]
    assert progress[0] == "work 2/20 items (10%) elapsed 0:00:00 eta 0:00:00"
    assert "a line of [output]" in lines and lines.index("a line of [output]") == 2  # in order, markup kept


def test_eta_counts_only_work_done_here(capsys, monkeypatch):
    """A resumed run: the steps done before the resume took no time here and do not speed the estimate up."""
    now = [100.0]
    monkeypatch.setattr("posttrain.progress.monotonic", lambda: now[0])
    bar = ProgressBar("step", 10, completed=5)
    assert bar.eta_s() is None
    now[0] += 30.0
    bar.update(6)  # one step in 30 s, four to go
    assert bar.eta_s() == pytest.approx(120.0)
    assert capsys.readouterr().out.strip() == "step 6/10 (60%) elapsed 0:00:30 eta 0:02:00"
    bar.close()


def test_disabled_progress_prints_only_messages(capsys):
    with ProgressBar("quiet", 4, enabled=False) as bar:
        bar.advance(4)
        bar.print("done")
    assert capsys.readouterr().out == "done\n"
