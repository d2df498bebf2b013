"""Asynchronous RL: the two-group runs of `posttrain train` (one generating process beside one or two training
processes: staleness bounds, partial rollouts, resume, failures and signals) and the settings it refuses. Weight sync
itself, between two bare processes, is in tests/test_async_weights.py."""

import json
import os
import sys
from pathlib import Path

import pytest

from tests.test_distributed import run_processes

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _task_args(tmp_path, model_dir, *extra):
    from posttrain.data.synthetic import write_task

    files = write_task(tmp_path / "data", seed=0, operands=range(0, 10), held_out=0, dev=4, copies=1)
    return [f"actor_rollout_ref.model.path={model_dir}", f"data.train_files={files['rl_train']}",
            "data.train_batch_size=4", "data.max_prompt_length=32", "data.max_response_length=6",
            "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
            "actor_rollout_ref.actor.optim.lr=1e-3", "actor_rollout_ref.model.enable_gradient_checkpointing=False",
            "algorithm.adv_estimator=grpo", "reward_model.num_workers=0", "trainer.val_before_train=False",
            "trainer.logger=['jsonl']", f"trainer.default_local_dir={tmp_path / 'run'}", "trainer.device=cpu",
            "rollout.n_gpus_per_node=1", *extra]


def _train(args, timeout=240):
    cmd = [sys.executable, "-m", "posttrain.cli", "train", *args]
    return run_processes(cmd, {**os.environ, "OMP_NUM_THREADS": "1"}, timeout=timeout)


def _steps(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def one_step_off_run(tmp_path_factory, tiny_model_dir):
    """A finished 3-step run of one generating and one training process, staleness_threshold=1, a checkpoint after
    every step. Returns the folder holding its data/ and run/."""
    base = tmp_path_factory.mktemp("one_step_off")
    result = _train(_task_args(base, tiny_model_dir, "trainer.total_training_steps=3", "trainer.save_freq=1",
                               "async_training.staleness_threshold=1"))
    assert result.returncode == 0, result.stderr[-4000:]
    return base


def test_one_step_off_policy_trains_on_batches_one_version_old_and_pushes_each_version(tmp_path, tiny_model_dir,
                                                                                         one_step_off_run):
    """One generating and one training process, staleness_threshold=1: batch 1 is sampled by the loaded weights
    (version 0) and trained at version 0; batch k > 1 was sampled by version k-2 while step k-1 trained, so it trains
    with staleness 1 — which also shows that each pushed version reached the generator. Every step corrects with
    the recomputed old log-probs (rollout-IS metrics logged), and the checkpoint records the step. With LoRA the
    same run pushes only the adapters (a fraction of the full push)."""
    steps = _steps(one_step_off_run / "run")
    assert [m["step"] for m in steps] == [1, 2, 3]
    assert [m["async/weight_version"] for m in steps] == [0, 1, 2]
    assert [m["async/rollout_version"] for m in steps] == [0, 0, 1]
    assert [m["async/staleness_max"] for m in steps] == [0, 1, 1]
    assert [m["async/staleness_mean"] for m in steps] == [0, 1, 1]
    for m in steps:
        assert "training/rollout_probs_diff_mean" in m and "timing_s/old_log_prob" in m, sorted(m)
        assert 0 <= m["async/train_idle_share"] <= 1 and 0 <= m["async/gen_idle_share"] <= 1
    assert (one_step_off_run / "run" / "global_step_3").is_dir()
    full_mb = steps[1]["async/weight_sync_mb"]  # step 2 pushed version 1 (step 3 trains the last batch: no push)
    assert "async/weight_sync_mb" not in steps[2]
    lora = tmp_path / "lora"
    lora.mkdir()
    args = _task_args(lora, tiny_model_dir, "trainer.total_training_steps=3", "actor_rollout_ref.model.lora_rank=4",
                      "actor_rollout_ref.model.lora_alpha=8", "async_training.staleness_threshold=1")
    result = _train(args)
    assert result.returncode == 0, result.stderr[-4000:]
    lora_steps = _steps(lora / "run")
    assert [m["async/staleness_max"] for m in lora_steps] == [0, 1, 1]
    assert 0 < lora_steps[1]["async/weight_sync_mb"] < full_mb / 5  # the adapters travel, not the model


def test_staleness_threshold_two_bounds_staleness_by_two(tmp_path, tiny_model_dir):
    """staleness_threshold=2: the generator may sample batch k with any version >= k-3, and takes the newest it
    holds: every batch trains at most 2 versions after the one that sampled it, the versions that sampled never go
    back, and with generation running ahead some batch is stale."""
    args = _task_args(tmp_path, tiny_model_dir, "trainer.total_training_steps=5",
                      "async_training.staleness_threshold=2")
    result = _train(args)
    assert result.returncode == 0, result.stderr[-4000:]
    steps = _steps(tmp_path / "run")
    versions = [m["async/rollout_version"] for m in steps]
    assert versions == sorted(versions) and versions[0] == 0
    assert all(m["async/weight_version"] - m["async/rollout_version"] <= 2 for m in steps)
    assert all(m["async/staleness_max"] <= 2 for m in steps) and max(m["async/staleness_max"] for m in steps) >= 1


def test_partial_rollouts_under_posttrain_train_keep_the_bound_and_mix_versions_within_a_batch(tmp_path,
                                                                                              tiny_model_dir):
    """partial_rollout=True with staleness_threshold=1: each batch starts with weights at most one version behind,
    pushes that land while it decodes are taken between two steps (`async/versions_taken_mid_batch`), and the
    staleness metrics (per token, from learn()) stay within 1: a token sampled after a swap counts the version of
    its prompt's keys, the oldest it attended to. Generation of 64-token responses outlasts a training step of the
    tiny model, so pushes land mid-generation."""
    args = [a for a in _task_args(tmp_path, tiny_model_dir, "trainer.total_training_steps=4",
                                  "async_training.staleness_threshold=1", "async_training.partial_rollout=True")
            if not a.startswith("data.max_response_length")] + ["data.max_response_length=64"]
    result = _train(args)
    assert result.returncode == 0, result.stderr[-4000:]
    steps = _steps(tmp_path / "run")
    assert [m["async/weight_version"] for m in steps] == [0, 1, 2, 3]
    assert all(m["async/staleness_max"] <= 1 for m in steps)
    assert any(m["async/versions_taken_mid_batch"] > 0 for m in steps), steps


def test_partial_rollouts_of_multi_turn_episodes_with_lora_train_under_posttrain_train(tmp_path, tiny_model_dir):
    """partial_rollout=True with multi-turn episodes (guess_number) and LoRA on one generating and one training
    process: three steps train on the episodes (finite losses, the rollout-IS correction logged), each batch within
    one version of the weights it trains at, and the pushes carry the adapters alone."""
    from posttrain.agents.envs.guess_number import guess_number_rows

    data = tmp_path / "guess.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in guess_number_rows(8, 1, 9, seed=0, max_guesses=3)))
    drop = ("data.train_files", "data.max_prompt_length", "data.max_response_length")
    args = [a for a in _task_args(tmp_path, tiny_model_dir, "trainer.total_training_steps=3",
                                  "async_training.staleness_threshold=1", "async_training.partial_rollout=True")
            if not a.startswith(drop)]
    args += [f"data.train_files={data}", "data.max_prompt_length=160", "data.max_response_length=64",
             "actor_rollout_ref.model.lora_rank=4", "actor_rollout_ref.model.lora_alpha=8",
             "actor_rollout_ref.rollout.multi_turn.enable=True",
             "actor_rollout_ref.rollout.multi_turn.max_assistant_turns=3",
             "actor_rollout_ref.rollout.agent.default_agent_loop=guess_number"]
    result = _train(args)
    assert result.returncode == 0, result.stderr[-4000:]
    steps = _steps(tmp_path / "run")
    assert [m["async/weight_version"] for m in steps] == [0, 1, 2]
    assert all(m["async/staleness_max"] <= 1 and m["actor/pg_loss"] == m["actor/pg_loss"] for m in steps)
    assert all("agent/turns/mean" in m and "training/rollout_probs_diff_mean" in m for m in steps)
    assert 0 < steps[0]["async/weight_sync_mb"] < 0.1  # rank-4 adapters of a 64-wide model: tens of kB


def test_trigger_parameter_sync_step_pushes_every_two_steps_and_bounds_generation_by_two_batches(tmp_path,
                                                                                                 tiny_model_dir):
    """trigger_parameter_sync_step=2, staleness_threshold=0: weights are pushed after steps 2, 4, ... only, and
    (1 + 0) x 2 = 2 batches may be generated per push: batches 1-2 with the loaded weights, batches 3-4 with version
    2 (batch 3 must wait for it), so staleness runs 0, 1, 0, 1 and only step 2 logs a push."""
    args = _task_args(tmp_path, tiny_model_dir, "trainer.total_training_steps=4",
                      "async_training.staleness_threshold=0", "async_training.trigger_parameter_sync_step=2")
    result = _train(args)
    assert result.returncode == 0, result.stderr[-4000:]
    steps = _steps(tmp_path / "run")
    assert [m["async/rollout_version"] for m in steps] == [0, 0, 2, 2]
    assert [m["async/staleness_max"] for m in steps] == [0, 1, 0, 1]
    assert ["async/weight_sync_mb" in m for m in steps] == [False, True, False, False]


def test_verl_default_fractional_staleness_generates_no_whole_batch_ahead(tmp_path, tiny_model_dir):
    """staleness_threshold=0.1 (verl's default) with one step per push: floor(1.1 x 1) = 1 batch per push, as
    staleness_threshold=0 allows, so the generator waits for each step's weights: no whole batch is generated ahead,
    every batch is sampled by the version it trains at (staleness 0), and the versions advance one per step.
    (Threshold 0 itself runs in the trigger_parameter_sync_step test above, at two steps per push.)"""
    args = _task_args(tmp_path, tiny_model_dir, "trainer.total_training_steps=3",
                      "async_training.staleness_threshold=0.1")
    result = _train(args)
    assert result.returncode == 0, result.stderr[-4000:]
    steps = _steps(tmp_path / "run")
    assert [m["async/rollout_version"] for m in steps] == [0, 1, 2]
    assert [m["async/staleness_max"] for m in steps] == [0, 0, 0]


def test_require_batches_sizes_the_step_and_total_rollout_steps_counts_the_steps():
    """verl's fully asynchronous sizes: data.train_batch_size=0 becomes require_batches x ppo_mini_batch_size,
    rollout.total_rollout_steps prompts make total_rollout_steps // that many steps, a positive batch size that
    disagrees with require_batches is refused naming both, and hybrid_engine=False is accepted for two groups."""
    from posttrain.config import ConfigError, load_config

    base = ["rollout.n_gpus_per_node=1", "actor_rollout_ref.actor.ppo_mini_batch_size=4"]
    cfg = load_config(None, [*base, "data.train_batch_size=0", "async_training.require_batches=3",
                             "rollout.total_rollout_steps=100", "actor_rollout_ref.hybrid_engine=False"])
    assert cfg.data.train_batch_size == 12 and cfg.trainer.total_training_steps == 8
    with pytest.raises(ConfigError, match=r"require_batches=3 x ppo_mini_batch_size=4 .* set it to 12 or 0"):
        load_config(None, [*base, "data.train_batch_size=8", "async_training.require_batches=3"])
    with pytest.raises(ConfigError, match="train_batch_size must be positive"):  # synchronous: no such sizing
        load_config(None, ["data.train_batch_size=0", "async_training.require_batches=3"])


FULLY_ASYNC = Path(__file__).parent / "data" / "fully_async_scripts_2026_08"


SCORE_BY_TEXT = """
def compute_score(data_source, solution_str, ground_truth, extra_info):
    return float(sum(map(ord, solution_str)) % 5)  # varies within a group: advantages, and an update, not zero
"""


def test_two_training_processes_beside_one_generating_process_train_the_one_process_update(tmp_path,
                                                                                           tiny_model_dir):
    """trainer.n_gpus_per_node=2 beside rollout.n_gpus_per_node=1: one launch of 3 processes, the two trainers
    sharding the model (FSDP2 on their own group) and each taking its share of the generator's batch. The first
    update is the one a single process makes on the same batch (gradient norm to 1e-5 relative, weights within
    Adam's rounding bounds, from the step-1 checkpoint the trainers wrote together); the push of version 1, gathered
    whole from the shards, reaches the generator (its header's fingerprint accepted), which samples batch 2 with it:
    its log-probs are the trainers' recomputed ones."""
    import torch

    from posttrain.config import load_config
    from posttrain.parallel.checkpoint import load_role
    from posttrain.trainer.async_rl import async_defaults
    from posttrain.trainer.rl import RLTrainer
    from tests.same_update import assert_same_weights

    (tmp_path / "reward.py").write_text(SCORE_BY_TEXT)
    common = [f"custom_reward_function.path={tmp_path / 'reward.py'}", "actor_rollout_ref.model.dtype=fp32",
              "actor_rollout_ref.rollout.dtype=fp32", "trainer.total_training_steps=2"]
    args = _task_args(tmp_path, tiny_model_dir, *common, "trainer.n_gpus_per_node=2", "trainer.save_freq=1",
                      "async_training.staleness_threshold=0", "async_training.wait_timeout_s=120")
    result = _train(args, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    steps = _steps(tmp_path / "run")
    assert [m["step"] for m in steps] == [1, 2]
    assert [m["async/rollout_version"] for m in steps] == [0, 1]
    assert steps[1]["training/rollout_probs_diff_max"] < 1e-4  # fp32: sampled with the trainers' version 1

    one = tmp_path / "one"  # the same first batch and step in this process (synchronous RL, same seed)
    cfg = load_config(None, [a for a in _task_args(one, tiny_model_dir, *common) if a != "rollout.n_gpus_per_node=1"])
    async_defaults(cfg)
    torch.manual_seed(cfg.trainer.seed)
    trainer = RLTrainer(cfg)
    start = {k: v.detach().clone() for k, v in trainer.parts.actor.model.state_dict().items()}
    trainer.global_step = 1
    want = trainer.train_step()
    assert want["critic/score/mean"] == steps[0]["critic/score/mean"]
    assert steps[0]["actor/grad_norm"] == pytest.approx(want["actor/grad_norm"], rel=1e-5)
    want_state = {k: v.detach().clone() for k, v in trainer.parts.actor.model.state_dict().items()}
    assert max(float((want_state[k] - start[k]).abs().max()) for k in start) > 5e-4  # an update of ~lr = 1e-3
    shards = sorted((tmp_path / "run" / "global_step_1" / "actor").glob("*.distcp"))
    assert len(shards) == 2, shards  # each trainer wrote its own shards
    load_role(tmp_path / "run" / "global_step_1" / "actor", trainer.parts.actor.model, alone=True)
    assert_same_weights(want_state, trainer.parts.actor.model.state_dict(), [{"lr": 1e-3}], "after step 1")


def test_verl_fully_async_script_trains_two_steps_on_two_processes(tmp_path, tiny_model_dir):
    """verl's fully asynchronous DAPO script (data.train_batch_size=0, require_batches=4, trigger_parameter_sync_step
    =4, staleness_threshold=0.1, partial_rollout=True, hybrid_engine=False, rollout.total_rollout_steps) with its
    paths changed and the size knobs the recorded scripts train with, on one generating and one training process:
    it loads, a step takes 4 x ppo_mini_batch_size prompts, and two steps train with per-token staleness metrics."""
    sys.path.insert(0, str(Path(__file__).parents[1] / "tools"))
    from verl_examples import SMALL

    from posttrain.data.preprocess import prepare

    data = str(prepare("gsm8k", None, tmp_path / "gsm8k")["train"][0])
    record = json.loads((FULLY_ASYNC / "dapo_7b_math_fsdp2_4_4.json").read_text())
    argv = [a.replace("$MODEL_PATH", str(tiny_model_dir)).replace("$TRAIN_FILES", data).replace("$VAL_FILES", data)
            for a in record["argv"]]
    small = [s.replace("STEPS", "2").replace("RUN_DIR", str(tmp_path / "run")) for s in SMALL
             if not s.startswith("data.train_batch_size=")]  # the script's 0: require_batches x mini-batch
    result = _train([*argv, *small, "rollout.n_gpus_per_node=1", "data.train_max_samples=64"], timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    steps = [m for m in _steps(tmp_path / "run") if "actor/pg_loss" in m]
    assert [m["step"] for m in steps] == [1, 2]
    assert all(m["async/staleness_max"] <= 1 for m in steps)
    assert "data.train_batch_size=0 -> 16" in result.stderr


FAILING_REWARD = """
calls = 0

def compute_score(data_source, solution_str, ground_truth, extra_info):
    global calls
    calls += 1
    if calls > 8:  # the first batch's 8 responses score; the second batch's raise
        raise ValueError("scorer broke")
    return 0.0
"""


def test_a_generating_process_that_fails_stops_the_run_with_its_own_error(tmp_path, tiny_model_dir):
    """The generator's scorer fails on the second batch while the trainer waits for it: the run ends (no hang)
    and the error reported is the generator's own, not the trainer's broken connection."""
    (tmp_path / "reward.py").write_text(FAILING_REWARD)
    args = _task_args(tmp_path, tiny_model_dir, "trainer.total_training_steps=3",
                      f"custom_reward_function.path={tmp_path / 'reward.py'}", "async_training.wait_timeout_s=120")
    result = _train(args)
    assert result.returncode != 0
    assert "rank 1 failed" in result.stderr and "failed to score" in result.stderr, result.stderr[-3000:]


def test_resume_starts_the_generator_from_the_checkpoint_s_weights_and_data_position(tmp_path, tiny_model_dir,
                                                                                       one_step_off_run):
    """A copy of the 3-step run (stopped after step 3) resumes at step 4: the trainer sends the generator the
    checkpoint's weights (version 3) and data position, so batch 4 is sampled by version 3 (staleness 0), batch 5 by
    version 3 again (staleness 1), and the data position after step 5 is 5 batches: nothing skipped, nothing drawn
    twice."""
    import shutil

    import torch

    shutil.copytree(one_step_off_run / "run", tmp_path / "run")
    second = _train(_task_args(tmp_path, tiny_model_dir, "trainer.total_training_steps=5", "trainer.save_freq=1",
                               "async_training.staleness_threshold=1", "trainer.resume_allow_config_change=True"))
    assert second.returncode == 0, second.stderr[-4000:]
    steps = _steps(tmp_path / "run")
    assert [m["step"] for m in steps] == [1, 2, 3, 4, 5]
    assert [m["async/rollout_version"] for m in steps[3:]] == [3, 3]
    assert [m["async/staleness_max"] for m in steps[3:]] == [0, 1]
    extra = torch.load(tmp_path / "run" / "global_step_5" / "extra.pt", weights_only=True)
    assert extra["data_cursor"] == 5 and extra["step"] == 5


def test_settings_async_rl_does_not_support_are_refused_at_load():
    """A negative threshold, no updates per push, partial rollouts of agent programs, several generating
    processes, several training nodes, a training layout other than FSDP2 over all trainers and offloaded roles are
    refused before anything starts, each naming its key; partial rollouts of multi-turn
    episodes and of LoRA adapters load."""
    from posttrain.config import ConfigError, load_config

    cases = {"async_training.staleness_threshold=-0.5": ["async_training.staleness_threshold=-0.5"],
             "trigger_parameter_sync_step=0": ["async_training.trigger_parameter_sync_step=0"],
             "agent.program is not": ["async_training.partial_rollout=True",
                                      "actor_rollout_ref.rollout.agent.program=mod:fn"],
             "rollout.n_gpus_per_node=2": ["rollout.n_gpus_per_node=2"],
             "trainer.nnodes=2": ["trainer.nnodes=2"],
             "fsdp_size=1": ["trainer.n_gpus_per_node=2", "actor_rollout_ref.actor.fsdp_config.fsdp_size=1"],
             "param_offload": ["actor_rollout_ref.actor.fsdp_config.param_offload=True"]}
    for needle, overrides in cases.items():
        with pytest.raises(ConfigError, match=needle.replace(".", r"\.")):
            load_config(None, ["rollout.n_gpus_per_node=1", *overrides])
    load_config(None, ["rollout.n_gpus_per_node=1", "async_training.staleness_threshold=0.1"])  # fractions: fine
    load_config(None, ["rollout.n_gpus_per_node=1", "trainer.n_gpus_per_node=2"])  # FSDP2 over 2 trainers
    load_config(None, ["rollout.n_gpus_per_node=1", "async_training.partial_rollout=True"])
    load_config(None, ["rollout.n_gpus_per_node=1", "async_training.partial_rollout=True",
                       "actor_rollout_ref.rollout.multi_turn.enable=True", "actor_rollout_ref.model.lora_rank=4"])


def test_sigterm_stops_both_groups_after_a_step_with_a_checkpoint(tmp_path, tiny_model_dir):
    """SIGTERM to the command: the trainer finishes its step and saves; the generator, which keeps generating
    through the signal, is sent STOP and has its batches on the way taken until it says DONE, so both processes end
    cleanly (no broken connection, no hang) with the usual resume message."""
    import signal
    import subprocess
    import time

    run = tmp_path / "run"
    args = _task_args(tmp_path, tiny_model_dir, "trainer.total_training_steps=40", "trainer.save_freq=-1",
                      "async_training.staleness_threshold=1")
    proc = subprocess.Popen([sys.executable, "-m", "posttrain.cli", "train", *args], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    deadline = time.monotonic() + 240
    while not (run / "metrics.jsonl").is_file() and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    try:
        _, err = proc.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise AssertionError("still running 240 s after SIGTERM (a hang?)") from None
    assert proc.returncode == 128 + signal.SIGTERM, err[-3000:]
    saved = sorted(run.glob("global_step_*"))
    assert len(saved) == 1 and "Traceback" not in err, err[-3000:]
    assert f"stopped by SIGTERM after step {saved[0].name.rsplit('_', 1)[1]}" in err


def _rank_pids(root: int, rank: int) -> list[int]:
    """The processes below `root` that the launcher started as `rank` (RANK in their environment)."""
    from pathlib import Path as P

    def parent(pid) -> int:
        return int((P("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[1])

    found = []
    for p in P("/proc").iterdir():
        try:
            if not p.name.isdigit() or f"RANK={rank}".encode() not in (p / "environ").read_bytes().split(b"\0"):
                continue
            q = parent(int(p.name))
            while q > 1 and q != root:
                q = parent(q)
        except (OSError, ValueError):
            continue
        if q == root:
            found.append(int(p.name))
    return found


def _start_and_kill(args, run, rank, ready):
    """Start `posttrain train`, SIGKILL rank `rank` once `ready(run)` holds; the command's exit code and stderr."""
    import signal
    import subprocess
    import time

    proc = subprocess.Popen([sys.executable, "-m", "posttrain.cli", "train", *args], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    deadline = time.monotonic() + 240
    while not ready(run) and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.1)
    pids = _rank_pids(proc.pid, rank)
    assert proc.poll() is None and pids, "the run ended before the kill"
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    try:
        _, err = proc.communicate(timeout=180)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise AssertionError("still running 180 s after a rank was killed (a hang?)") from None
    return proc.returncode, err


def test_kill_9_of_the_generating_process_stops_the_run_with_its_own_error(tmp_path, tiny_model_dir):
    """SIGKILL to the generating process mid-run: the run ends (no hang, well within wait_timeout_s) and the error
    reported names the killed rank and its signal, not only the trainer's broken connection."""
    args = _task_args(tmp_path, tiny_model_dir, "trainer.total_training_steps=40", "trainer.save_freq=-1",
                      "async_training.staleness_threshold=1", "async_training.wait_timeout_s=600")
    code, err = _start_and_kill(args, tmp_path / "run", 1, lambda run: (run / "metrics.jsonl").is_file())
    assert code != 0
    assert "rank 1 failed (exit code -9)" in err, err[-3000:]


def test_kill_9_of_the_trainer_resumes_losing_only_the_batches_in_flight(tmp_path, tiny_model_dir):
    """SIGKILL to the training process after its second checkpoint: the run ends naming rank 0; resumed, it
    continues with the steps after the last checkpoint saved and ends with the data position of every step
    trained: the batches in flight were generated again, none skipped."""
    import torch

    common = ["trainer.save_freq=1", "async_training.staleness_threshold=1", "async_training.wait_timeout_s=600"]
    args = _task_args(tmp_path, tiny_model_dir, "trainer.total_training_steps=40", *common)
    code, err = _start_and_kill(args, tmp_path / "run", 0, lambda run: (run / "global_step_2" / "extra.pt").is_file())
    assert code != 0 and "rank 0 failed (exit code -9)" in err, err[-3000:]
    saved = max(int(p.name.rsplit("_", 1)[1]) for p in (tmp_path / "run").glob("global_step_*")
                if (p / "extra.pt").is_file())
    total = saved + 2
    result = _train(_task_args(tmp_path, tiny_model_dir, f"trainer.total_training_steps={total}", *common,
                               "trainer.resume_allow_config_change=True"))
    assert result.returncode == 0, result.stderr[-4000:]
    resumed = [m["step"] for m in _steps(tmp_path / "run")]
    assert resumed[-2:] == [saved + 1, saved + 2], resumed
    extra = torch.load(tmp_path / "run" / f"global_step_{total}" / "extra.pt", weights_only=True)
    assert extra["data_cursor"] == total and extra["step"] == total
