"""Kills and signals, as a cluster delivers them: the command line on a tiny task is killed with SIGKILL at seeded
random moments — in the middle of a step and in the middle of a checkpoint write — and restarted until it finishes;
its metrics must equal an uninterrupted run's exactly. SIGTERM stops a run after a saved step with a message saying
how to resume, and the resumed run is bit-exact too (in 2 processes as well); a SIGTERM during start-up says there
is nothing to resume. tools/kill_test.py runs the same with many more kills."""

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
from kill_test import kill  # the statistics tool's kill: one definition

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

REWARD = "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n" \
         "    return (sum(map(ord, solution_str)) % 5) / 4.0  # varies between responses: a non-zero gradient\n"
PAUSE = 0.6  # seconds the checkpoint write is held open, so that a kill can land in it


@pytest.fixture(scope="module")
def task(tiny_model_dir, tmp_path_factory):
    from posttrain.data.synthetic import write_task

    base = tmp_path_factory.mktemp("crash")
    data = write_task(base / "data", seed=0, operands=range(0, 10), held_out=0, dev=10)["rl_train"]
    (base / "reward.py").write_text(REWARD)
    return base, data, tiny_model_dir


def args(task, run, steps, *extra):
    base, data, model = task
    return ["train", "algorithm.adv_estimator=grpo", "data.train_batch_size=4", "data.max_prompt_length=32",
            "data.max_response_length=6", "actor_rollout_ref.rollout.n=4", "actor_rollout_ref.actor.optim.lr=1e-3",
            "actor_rollout_ref.actor.ppo_mini_batch_size=4",
            "actor_rollout_ref.model.enable_gradient_checkpointing=False",
            f"actor_rollout_ref.model.path={model}", f"data.train_files={data}",
            f"custom_reward_function.path={base / 'reward.py'}", f"trainer.total_training_steps={steps}",
            f"trainer.default_local_dir={run}", "trainer.logger=['jsonl']", "trainer.val_before_train=False",
            "trainer.save_freq=1", *extra]


def start(argv, pause=0.0):
    env = {**os.environ, "POSTTRAIN_CKPT_PAUSE": str(pause), "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-m", "posttrain.cli", *argv], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)


def training_numbers(run):
    rows = [json.loads(line) for line in (Path(run) / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith(("timing_s", "perf"))} for r in rows]


def straight(argv):
    result = subprocess.run([sys.executable, "-m", "posttrain.cli", *argv], capture_output=True, text=True,
                            timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-3000:]


def loop_began(proc, run, since):
    """Wait until this process rewrote or appended metrics.jsonl (its loop is running); False if it ended first."""
    path = Path(run) / "metrics.jsonl"
    while proc.poll() is None:
        if path.is_file() and path.stat().st_mtime_ns != since:
            return True
        time.sleep(0.02)
    return False


def kill_at(proc, run, since, mid_checkpoint: bool, delay: float) -> bool:
    """SIGKILL the whole process group (every rank and the launcher, as a lost node): inside the next checkpoint
    write (after its stderr line), or `delay` seconds after the loop began. Returns whether the kill landed in a
    checkpoint write."""
    if mid_checkpoint:
        for line in proc.stderr:
            if line.startswith("[checkpoint write under way]"):
                time.sleep(PAUSE / 3)
                landed = proc.poll() is None
                kill(proc, run)
                return landed
        return False
    if loop_began(proc, run, since):
        time.sleep(delay)
    kill(proc, run)
    return False


def kill_and_resume(argv, run, rng, kills, sigterm_first=False):
    """Kill the run `kills` times (every other one inside a checkpoint write), then let it finish. With
    `sigterm_first`, the first stop is a SIGTERM to the launcher instead, which must save and exit 143."""
    landed = 0
    for i in range(kills):
        path = Path(run) / "metrics.jsonl"
        since = path.stat().st_mtime_ns if path.is_file() else None
        proc = start(argv, PAUSE)
        if sigterm_first and i == 0:
            assert loop_began(proc, run, since)
            proc.send_signal(signal.SIGTERM)
            _, err = proc.communicate(timeout=300)
            assert proc.returncode == 128 + signal.SIGTERM and "stopped by SIGTERM after step" in err, err[-3000:]
            assert err.count("SIGTERM: finishing this step") == 1  # said once, by rank 0
            continue
        landed += kill_at(proc, run, since, mid_checkpoint=i % 2 == 1, delay=rng.uniform(0.05, 0.8))
        proc.stderr.close()
    proc = start(argv)
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]
    return landed


SHUFFLED = ("actor_rollout_ref.actor.shuffle=True", "actor_rollout_ref.actor.ppo_mini_batch_size=2")
TWO_PROCESSES = ("trainer.n_gpus_per_node=2",)
STEPS = 4


@pytest.fixture(scope="module")
def straight_runs(task, tmp_path_factory):
    """The uninterrupted runs to compare with, one per variant (run once, shared by the tests)."""
    out = {}

    def run(variant):
        if variant not in out:
            path = tmp_path_factory.mktemp("straight")
            straight(args(task, path, STEPS, *variant))
            out[variant] = training_numbers(path)
        return out[variant]

    return run


@pytest.mark.parametrize("variant", [SHUFFLED, TWO_PROCESSES], ids=["shuffled_mini_batches", "two_processes"])
def test_sigkill_at_random_points_resumes_bit_exactly(task, straight_runs, tmp_path, variant):
    """A reward that varies, so the policy gradient is not zero; one kill in a step (in 2 processes a SIGTERM to
    the launcher instead: every rank stops after the same step), one in a checkpoint write. The SIGTERM lands as
    rank 0 starts its loop, where a loaded machine once found rank 1 still setting up or rank 0 starting its scorer
    workers; both were killed by the signal then (rank 1 and a worker in rank 0's process group)."""
    landed = kill_and_resume(args(task, tmp_path / "killed", STEPS, *variant), tmp_path / "killed",
                             random.Random(len(variant)), 2, sigterm_first=variant == TWO_PROCESSES)
    assert landed == 1  # the kill aimed at a checkpoint write hit one
    assert training_numbers(tmp_path / "killed") == straight_runs(variant)


def test_sigterm_saves_the_step_and_resumes_bit_exactly(task, straight_runs, tmp_path):
    argv = args(task, tmp_path / "stopped", STEPS, "trainer.save_freq=-1", *SHUFFLED)  # no periodic checkpoints
    proc = start(argv)
    assert loop_began(proc, tmp_path / "stopped", None)
    time.sleep(0.2)  # inside step 1 or 2
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 128 + signal.SIGTERM, err[-3000:]
    saved = sorted((tmp_path / "stopped").glob("global_step_*"))
    assert len(saved) == 1 and "Traceback" not in err
    assert f"stopped by SIGTERM after step {saved[0].name.rsplit('_', 1)[1]}; checkpoint written to {saved[0]}" in err
    assert "To resume, run the same command again" in err and f"trainer.resume_from_path={saved[0]}" in err
    straight(argv)
    assert training_numbers(tmp_path / "stopped") == straight_runs(SHUFFLED)


def held_in_start_up(argv, processes):
    """Start the command with each training process's start-up held open (POSTTRAIN_STARTUP_PAUSE) and return it,
    with the stderr lines read so far, once all `processes` of them say their start-up is under way."""
    env = {**os.environ, "POSTTRAIN_STARTUP_PAUSE": "120", "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "posttrain.cli", *argv], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)
    lines, seen = [], 0
    for line in proc.stderr:
        lines.append(line)
        seen += line.startswith("[start-up under way]")
        if seen == processes:
            break
    return proc, lines


@pytest.mark.parametrize("variant", [(), TWO_PROCESSES], ids=["one_process", "two_processes"])
def test_sigterm_during_start_up_says_there_is_nothing_to_resume(task, tmp_path, variant):
    """A signal before the first step (here while every training process is starting up): there is nothing to
    save, and the command says so once and exits with the signal's code, instead of ending without a word."""
    run = tmp_path / "run"
    proc, lines = held_in_start_up(args(task, run, STEPS, *variant), 2 if variant else 1)
    try:
        proc.send_signal(signal.SIGTERM)  # to the launcher when there are 2 processes: it passes the signal on
        _, err = proc.communicate(timeout=120)
    finally:
        kill(proc, run)
    err = "".join(lines) + err
    assert proc.returncode == 128 + signal.SIGTERM, err[-3000:]
    assert err.count("SIGTERM: stopped before the first step; nothing to resume (no checkpoint was written)") == 1, \
        err[-3000:]
    assert "Traceback" not in err and not list(run.glob("*global_step_*"))


SECOND_SIGNAL = """
import os, signal, sys, time
from posttrain.parallel import Parallel
from posttrain.trainer.preempt import GRACE_S, StopOnSignal
with StopOnSignal() as stop:
    os.kill(os.getpid(), signal.SIGINT)
    os.kill(os.getpid(), signal.SIGINT)  # a launcher's forwarded copy: not the second signal
    assert stop.agreed(Parallel()) == signal.SIGINT
    print("noted", flush=True)
    time.sleep(GRACE_S + 0.2)
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(5)
print("not reached")
"""


def test_second_signal_exits_at_once():
    result = subprocess.run([sys.executable, "-c", SECOND_SIGNAL], capture_output=True, text=True, timeout=60)
    assert result.returncode == 128 + signal.SIGINT, result.stderr
    assert result.stdout == "noted\n" and "SIGINT again: exiting now without a checkpoint" in result.stderr
