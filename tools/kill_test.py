"""kill -9 statistics: `posttrain train` on the tiny offline task, killed with SIGKILL at seeded random moments
(half of them aimed at a checkpoint write), restarted until it finishes, and compared with an uninterrupted run.

    python tools/kill_test.py --workdir /tmp/kills [--kills 8] [--steps 6] [--seed 0] [--scenarios grpo,...]

Scenarios: grpo (a reward that varies), shuffled (actor.shuffle=True, two mini-batches), ppo (a critic, adaptive KL
in the reward, critic.shuffle=True), two_processes (2 gloo processes). A kill counts as mid-checkpoint when it left a
`.tmp_global_step_*` folder behind. Prints one line per scenario and the totals that docs/reliability.md quotes.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAUSE = 0.6
REWARD = "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n" \
         "    return (sum(map(ord, solution_str)) % 5) / 4.0\n"
SCENARIOS = {
    "grpo": [],
    "shuffled": ["actor_rollout_ref.actor.shuffle=True", "actor_rollout_ref.actor.ppo_mini_batch_size=2"],
    "ppo": ["algorithm.adv_estimator=gae", "algorithm.kl_ctrl.type=adaptive", "algorithm.use_kl_in_reward=True",
            "critic.shuffle=True", "critic.model.path=MODEL", "critic.optim.lr=1e-3",
            "actor_rollout_ref.actor.shuffle=True", "actor_rollout_ref.actor.ppo_mini_batch_size=2"],
    "two_processes": ["trainer.n_gpus_per_node=2"],
}


def prepare(workdir: Path) -> tuple[Path, Path, Path]:
    sys.path.insert(0, str(ROOT))
    from posttrain.data.synthetic import tokenizer_corpus, write_task
    from posttrain.models.tiny import build_tiny_model

    model = workdir / "model"
    if not model.is_dir():
        build_tiny_model(model, tokenizer_corpus(0, 500), hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                         intermediate_size=128, seed=0)
    data = write_task(workdir / "data", seed=0, operands=range(0, 10), held_out=0, dev=10)["rl_train"]
    (workdir / "reward.py").write_text(REWARD)
    return model, data, workdir / "reward.py"


def argv(model, data, reward, run, steps, extra):
    return ["train", "algorithm.adv_estimator=grpo", "data.train_batch_size=4", "data.max_prompt_length=32",
            "data.max_response_length=6", "actor_rollout_ref.rollout.n=4", "actor_rollout_ref.actor.optim.lr=1e-3",
            "actor_rollout_ref.actor.ppo_mini_batch_size=4",
            "actor_rollout_ref.model.enable_gradient_checkpointing=False",
            f"actor_rollout_ref.model.path={model}", f"data.train_files={data}",
            f"custom_reward_function.path={reward}",
            f"trainer.total_training_steps={steps}", f"trainer.default_local_dir={run}", "trainer.logger=['jsonl']",
            "trainer.val_before_train=False", "trainer.save_freq=1",
            *[e.replace("MODEL", str(model)) for e in extra]]


def start(args, pause: float) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "POSTTRAIN_CKPT_PAUSE": str(pause), "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-m", "posttrain.cli", *args], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)


def numbers(run: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith(("timing_s", "perf"))} for r in rows]


def survivors(run) -> list[int]:
    """Processes still running with `run` on their command line (a worker that outlived its killed launcher)."""
    mark, found = f"trainer.default_local_dir={run}".encode(), []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if mark in cmdline.read_bytes().split(b"\0"):
                found.append(int(cmdline.parent.name))
        except OSError:
            pass
    return found


def kill(proc, run):
    """SIGKILL the process group of `proc`; its workers (each in a session of its own) must end with it."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()
    deadline = time.monotonic() + 10
    while survivors(run) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not survivors(run), f"processes outlived the killed launcher: {survivors(run)}"


def one_kill(args, run: Path, rng: random.Random, aim_at_checkpoint: bool) -> bool | None:
    """Start, kill once; True/False = the kill did/did not leave a cut checkpoint write, None = finished first."""
    for debris in run.glob(".tmp_global_step_*"):
        shutil.rmtree(debris)  # so that what is found after the kill is this kill's
    proc = start(args, PAUSE)
    if aim_at_checkpoint:
        skip = rng.randrange(3)  # which of the next checkpoint writes
        for line in proc.stderr:
            if line.startswith("[checkpoint write under way]"):
                if skip == 0:
                    time.sleep(rng.uniform(0.0, PAUSE))
                    break
                skip -= 1
    else:
        metrics = run / "metrics.jsonl"
        since = metrics.stat().st_mtime_ns if metrics.is_file() else None
        while proc.poll() is None and not (metrics.is_file() and metrics.stat().st_mtime_ns != since):
            time.sleep(0.02)
        time.sleep(rng.uniform(0.0, 2.0))
    finished = proc.poll() is not None
    kill(proc, run)
    proc.stderr.close()
    if finished and proc.returncode == 0:
        return None
    return bool(list(run.glob(".tmp_global_step_*")))


def scenario(name, model, data, reward, workdir: Path, steps: int, kills: int, seed: int) -> dict:
    extra = SCENARIOS[name]
    ref, run = workdir / f"{name}_straight", workdir / f"{name}_killed"
    for p in (ref, run):
        shutil.rmtree(p, ignore_errors=True)
    done = subprocess.run([sys.executable, "-m", "posttrain.cli", *argv(model, data, reward, ref, steps, extra)],
                          env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}, capture_output=True,
                          text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    rng = random.Random(f"{seed}-{name}")
    args = argv(model, data, reward, run, steps, extra)
    n_kills = mid = resumes = 0
    while n_kills < kills:
        resumes += any(run.glob("global_step_*"))
        landed = one_kill(args, run, rng, aim_at_checkpoint=n_kills % 2 == 1)
        if landed is None:  # the run finished before the kill: start over so that every kill has a run to hit
            shutil.rmtree(run)
            continue
        n_kills += 1
        mid += landed
    resumes += 1
    proc = start(args, 0.0)
    _, err = proc.communicate()
    assert proc.returncode == 0, err[-2000:]
    a, b = numbers(run), numbers(ref)
    assert [r["step"] for r in a] == [r["step"] for r in b], (name, [r["step"] for r in a])
    diff = max((abs(x[k] - y[k]) for x, y in zip(a, b) for k in y), default=0.0)
    assert all(x.keys() == y.keys() for x, y in zip(a, b))
    return {"scenario": name, "kills": n_kills, "mid_checkpoint": mid, "resumes": resumes, "max_abs_diff": diff}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workdir", type=Path, required=True)
    p.add_argument("--kills", type=int, default=8, help="kills per scenario")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--scenarios", default=",".join(SCENARIOS))
    a = p.parse_args()
    a.workdir.mkdir(parents=True, exist_ok=True)
    model, data, reward = prepare(a.workdir)
    rows = []
    for name in a.scenarios.split(","):
        t = time.time()
        rows.append(scenario(name, model, data, reward, a.workdir, a.steps, a.kills, a.seed))
        print(json.dumps(rows[-1]), f"({time.time() - t:.0f} s)", flush=True)
    total = {k: sum(r[k] for r in rows) for k in ("kills", "mid_checkpoint", "resumes")}
    total["max_abs_diff"] = max(r["max_abs_diff"] for r in rows)
    print("total", json.dumps(total))


if __name__ == "__main__":
    main()
