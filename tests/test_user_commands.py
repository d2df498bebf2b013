"""`posttrain eval`, `plot`, `runs` on a finished run, and the progress display of `sft`, `prepare` and `export`."""

import json
import shutil
from collections import Counter, defaultdict

import pytest

from posttrain.cli import main

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

VAL = "val-core/synthetic/arithmetic/acc/mean@1"


def last_metrics(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()][-1]


def eval_args(model, data, out, *extra):
    return ["eval", str(model), "--data", str(data), "--max-samples", "16", "--max-new-tokens", "8",
            "--num-workers", "0", "-o", str(out), *extra]


def read_eval(out):
    return json.loads(out.with_name(out.stem + ".metrics.json").read_text())


# ------------------------------------------------------------------ eval


def test_eval_of_the_checkpoint_and_its_export_repeats_the_runs_own_validation(finished_run, tmp_path, capsys):
    """Greedy decoding of the validation prompts with the run's response length gives the accuracy the run logged
    at its last step: from the run folder, from RUN_DIR/global_step_N, and from the exported Hugging Face folder."""
    run, want = finished_run["run"], last_metrics(finished_run["run"])[VAL]
    assert main(eval_args(run, finished_run["val"], tmp_path / "run.jsonl")) == 0
    out, err = capsys.readouterr()
    assert read_eval(tmp_path / "run.jsonl")["metrics"][VAL] == pytest.approx(want)
    assert read_eval(tmp_path / "run.jsonl")["model"] == str(run / "global_step_3")
    assert "mean@1" in out and "synthetic/arithmetic" in out and f"{want:.1%}" in out
    assert "eval 16/16 prompts (100%)" in err

    assert main(["export", str(run / "global_step_3"), str(tmp_path / "hf")]) == 0
    assert "export 3/3 stages (100%)" in capsys.readouterr().err
    for model, name in ((run / "global_step_3", "step.jsonl"), (tmp_path / "hf", "hf.jsonl")):
        assert main(eval_args(model, finished_run["val"], tmp_path / name)) == 0
        assert read_eval(tmp_path / name)["metrics"][VAL] == pytest.approx(want), model
    rows = [json.loads(line) for line in (tmp_path / "hf.jsonl").read_text().splitlines()]
    assert len(rows) == 16 and {"prompt", "response", "ground_truth", "answer", "score"} <= set(rows[0])


def test_eval_sampling_metrics_agree_with_the_samples_written(finished_run, tmp_path):
    out = tmp_path / "n4.jsonl"
    assert main(eval_args(finished_run["run"], finished_run["val"], out, "--n", "4", "--temperature", "1.0")) == 0
    metrics = read_eval(out)["metrics"]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 64
    per_prompt = defaultdict(list)
    for r in rows:
        per_prompt[r["index"]].append(r)
    assert len(per_prompt) == 16 and all(sorted(r["sample"] for r in g) == [0, 1, 2, 3] for g in per_prompt.values())
    prefix = "synthetic/arithmetic/acc"
    assert set(metrics) == {f"val-core/{prefix}/mean@4", *(f"val-aux/{prefix}/{m}" for m in
                                                            ("maj@4", "best@4", "pass@1", "pass@2", "pass@4"))}
    assert metrics[f"val-core/{prefix}/mean@4"] == pytest.approx(sum(r["score"] for r in rows) / 64)
    assert metrics[f"val-aux/{prefix}/pass@4"] == pytest.approx(
        sum(any(r["score"] > 0 for r in g) for g in per_prompt.values()) / 16)

    def majority(group):
        votes = Counter(r["answer"] for r in group if r["answer"] is not None)
        return next(r["score"] for r in group if r["answer"] == votes.most_common(1)[0][0]) if votes else 0.0

    assert metrics[f"val-aux/{prefix}/maj@4"] == pytest.approx(sum(map(majority, per_prompt.values())) / 16)


def test_eval_refuses_bad_flags_and_folders_without_a_model(finished_run, tmp_path, capsys):
    assert main(eval_args(finished_run["run"], finished_run["val"], tmp_path / "x.jsonl", "--n", "4")) == 2
    assert "--n 4 with --temperature 0 (greedy) gives the same answer 4 times" in capsys.readouterr().err
    assert main(eval_args(finished_run["run"], tmp_path / "missing.jsonl", tmp_path / "x.jsonl", "--top-p", "0")) == 2
    err = capsys.readouterr().err
    assert "2 problems" in err and "--top-p=0.0 must lie in (0, 1]" in err and "missing.jsonl' does not exist" in err
    no_ckpt = tmp_path / "no_ckpt"
    no_ckpt.mkdir()
    shutil.copy(finished_run["run"] / "metrics.jsonl", no_ckpt)
    assert main(eval_args(no_ckpt, finished_run["val"], tmp_path / "x.jsonl")) == 2
    assert "run folder without a checkpoint" in capsys.readouterr().err


# ------------------------------------------------------------------ plot and runs


@pytest.fixture
def two_runs(finished_run, tmp_path):
    """The finished run and a copy whose metrics are scaled, side by side (plot and runs read only the files)."""
    runs = tmp_path / "runs"
    shutil.copytree(finished_run["run"], runs / "a" / "run", ignore=shutil.ignore_patterns("wandb", "tensorboard"))
    other = runs / "b" / "run"
    shutil.copytree(runs / "a" / "run", other)
    rows = [json.loads(line) for line in (other / "metrics.jsonl").read_text().splitlines()]
    (other / "metrics.jsonl").write_text("".join(json.dumps({k: v if k == "step" else v * 0.5 for k, v in r.items()})
                                                 + "\n" for r in rows))
    return runs


def test_plot_overlays_the_runs_with_titles_axes_and_legends(two_runs, tmp_path, capsys):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from posttrain.trainer.plots import _draw, read_metrics

    a, b = two_runs / "a" / "run", two_runs / "b" / "run"
    assert main(["plot", str(a), str(b), "-o", str(tmp_path / "plots")]) == 0
    written = capsys.readouterr().out.split()
    names = {p.rsplit("/", 1)[1] for p in written}
    assert {"reward.png", "val_accuracy.png", "response_length.png", "entropy.png", "overview.png"} <= names
    assert "vf_loss.png" not in names  # GRPO has no critic: nothing logged, nothing drawn
    for path in written:
        assert open(path, "rb").read(8) == b"\x89PNG\r\n\x1a\n"
    fig, ax = plt.subplots()
    _draw(ax, "Validation accuracy", "val-core/", "accuracy", [("a/run", read_metrics(a)), ("b/run", read_metrics(b))])
    assert ax.get_title() == "Validation accuracy: synthetic/arithmetic mean@1"
    assert ax.get_xlabel() == "training step" and ax.get_ylabel() == "accuracy"
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["a/run", "b/run"]
    assert [list(line.get_xdata()) for line in ax.get_lines()] == [[0, 1, 2, 3]] * 2
    plt.close(fig)
    assert main(["plot", str(a)]) == 0 and (a / "plots" / "overview.png").is_file()  # default: RUN_DIR/plots


def test_runs_lists_algorithm_steps_reward_and_accuracy(two_runs, finished_run, capsys):
    assert main(["runs", str(two_runs)]) == 0
    out = capsys.readouterr().out
    last = last_metrics(finished_run["run"])
    lines = {line.split()[1]: line for line in out.splitlines() if "/run " in line}
    assert set(lines) == {"a/run", "b/run"}
    for name, scale in (("a/run", 1.0), ("b/run", 0.5)):
        cells = [c.strip() for c in lines[name].strip("│ ").split("│")]
        assert cells == [name, "grpo", "3/3", f"{last['critic/score/mean'] * scale:.3f}", f"{last[VAL] * scale:.1%}",
                         "global_step_3"]


def test_runs_in_an_empty_folder_says_so(tmp_path, capsys):
    assert main(["runs", str(tmp_path)]) == 1
    assert "no runs in" in capsys.readouterr().err


# ------------------------------------------------------------------ progress of the other long commands


def test_sft_shows_progress_and_its_evaluations(tiny_model_dir, small_task, tmp_path, capsys):
    from posttrain.trainer.sft import SFTArgs, run_sft

    _, files = small_task
    run_sft(SFTArgs(model_path=str(tiny_model_dir), train_files=[str(files["sft_train"])], output_dir=str(tmp_path),
                    epochs=0.14, batch_size=32, max_length=64, eval_every=2))
    lines = capsys.readouterr().out.splitlines()
    assert [l.split()[1] for l in lines if l.startswith("sft ") and " eta " in l] == ["1/3", "2/3", "3/3"]
    assert any(l.startswith("sft 3/3 steps (100%) elapsed ") for l in lines)
    assert [l.split()[1] for l in lines if l.startswith("sft step=")] == ["step=2", "step=3"]


def test_prepare_shows_progress(tmp_path, capsys):
    assert main(["prepare", "code", "--output-dir", str(tmp_path)]) == 0
    err = capsys.readouterr().err
    assert "prepare code 4/4 stages (100%)" in err and " eta " in err


# ------------------------------------------------------------------ episodes


def logged_run(tmp_path):
    from posttrain.agents.episode import Episode
    from posttrain.agents.episode_log import episodes_file, write_episodes

    def ep(answer, errors=None):
        e = Episode(prompt_ids=[1], row={"data_source": "openai/gsm8k", "agent_name": "tool_agent"}, messages=[
            {"role": "system", "content": "Use [bold]tools[/bold]."}, {"role": "user", "content": "12*13?"},
            {"role": "assistant", "content": '<tool_call>{"name": "calc", "arguments": {"x": "12*13"}}</tool_call>'},
            {"role": "tool", "name": "calc", "content": "156"}, {"role": "assistant", "content": answer}])
        e.assistant_turns, e.tool_calls, e.tool_errors = 2, 1, errors or {}
        return e

    write_episodes(episodes_file(tmp_path, 2), [ep("#### 100")], [0.0])
    write_episodes(episodes_file(tmp_path, 4), [ep("#### 156"), ep("#### 15", {"timeout": 1}), ep("x")],
                   [1.0, 0.0, 0.0])
    return tmp_path


def test_episodes_prints_the_latest_steps_conversations_plainly_in_a_pipe(tmp_path, capsys):
    """Without --step: the latest logged step; each episode's header (reward, turns, tool calls, errors) and every
    message under its role, the text as written (no markup read into it, no colour codes in a pipe)."""
    assert main(["episodes", str(logged_run(tmp_path)), "--limit", "2"]) == 0
    out = capsys.readouterr().out
    assert "\x1b[" not in out
    assert "step 4 · episode 0 of 3 · openai/gsm8k · tool_agent" in out and "episode 1 of 3" in out
    assert "episode 2 of 3" not in out and "2 of 3 episodes shown" in out
    assert "reward 1 (score 1 + env 0) · turns 2 · tool calls 1" in out and "tool errors: timeout 1" in out
    for line in ["[system] Use [bold]tools[/bold].", "[user] 12*13?",
                 '[assistant] <tool_call>{"name": "calc", "arguments": {"x": "12*13"}}</tool_call>',
                 "[tool calc] 156", "[assistant] #### 156", "[assistant] #### 15"]:
        assert line in out.splitlines()


def test_episodes_picks_a_step_and_an_index(tmp_path, capsys):
    run = logged_run(tmp_path)
    assert main(["episodes", str(run), "--step", "2"]) == 0
    assert "[assistant] #### 100" in capsys.readouterr().out
    assert main(["episodes", str(run), "--index", "2"]) == 0
    out = capsys.readouterr().out
    assert "episode 2 of 3" in out and "episode 0 " not in out and "[assistant] x" in out


def test_episodes_colours_roles_on_a_terminal(tmp_path):
    import io

    from rich.console import Console

    from posttrain.trainer.episodes import show_episodes

    buffer = io.StringIO()
    show_episodes(logged_run(tmp_path), console=Console(file=buffer, force_terminal=True, highlight=False))
    styled = {role: f"[{role}" in buffer.getvalue() and f"m[{role}" in buffer.getvalue()
              for role in ("system", "user", "assistant", "tool")}
    assert styled == dict.fromkeys(styled, True)  # each role label right after a colour code


def test_episodes_says_what_a_folder_holds_instead(tmp_path, capsys):
    (tmp_path / "metrics.jsonl").write_text("")
    assert main(["episodes", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "no episodes in" in err and "episodes/step_N.jsonl" in err and "It holds: metrics.jsonl" in err
    run = logged_run(tmp_path)
    assert main(["episodes", str(run), "--step", "3"]) == 1
    assert "steps with episodes: 2, 4" in capsys.readouterr().err
    assert main(["episodes", str(run), "--index", "3"]) == 1
    assert "step 4 logged 3 episodes: --index takes 0 to 2" in capsys.readouterr().err
    assert main(["episodes", str(tmp_path / "missing")]) == 1
    assert "is not a folder" in capsys.readouterr().err
