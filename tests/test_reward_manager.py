"""Batch scoring: score placement, dict scores, the reward managers (naive / batch / prime / dapo), the scorer pool
(timeouts, crashes, replaced workers, scorers that start processes), rewards that are not finite numbers, and a
training run with a faulty reward function under the default settings."""

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import faulty_scorers
from posttrain.config import ConfigError, load_config
from posttrain.data.batch import Batch
from posttrain.reward.checks import RewardError, check_error_rate
from posttrain.reward.manager import RewardManager, auto_workers, overlong_penalty

FAULTY = Path(faulty_scorers.__file__)


class FakeTokenizer:
    """Token id k decodes to chr(ord('a') + k); enough to check what the scorer sees."""

    def batch_decode(self, seqs, skip_special_tokens=True):
        return ["".join(chr(ord("a") + t) for t in s) for s in seqs]


def make_batch(responses, mask, sources=None, truths=None, extras=None):
    n = len(responses)
    return Batch({"responses": torch.tensor(responses), "response_mask": torch.tensor(mask)},
                 {"data_source": sources or ["t"] * n, "ground_truth": truths or ["x"] * n,
                  "extra_info": extras or [{}] * n})


def rows(*dos, length=2):
    """A batch of responses of `length` tokens, one per behaviour of faulty_scorers.by_extra."""
    extras = [d if isinstance(d, dict) else {"do": d} for d in dos]
    return make_batch([[0] * length] * len(dos), [[1] * length] * len(dos), extras=extras)


def scorer(data_source, solution_str, ground_truth, extra_info):
    if solution_str == "ab":
        return 1.0
    if solution_str == "c":
        return {"score": 0.5, "format_ok": True}
    if solution_str == "d":
        raise RuntimeError("boom")
    return 0.0


def test_scores_land_on_last_valid_token():
    rm = RewardManager(FakeTokenizer(), compute_score=scorer)
    batch = make_batch([[0, 1, 5], [2, 9, 9], [3, 0, 0], [4, 4, 4]], [[1, 1, 0], [1, 0, 0], [1, 0, 0], [0, 0, 0]])
    with pytest.warns(RuntimeWarning, match="reward function raised"):
        scores, extras = rm(batch)
    assert scores.tolist() == [[0, 1.0, 0], [0.5, 0, 0], [0, 0, 0], [0, 0, 0]]
    # an extra key is None where the row's scorer did not return it (its metric averages the rows that have it)
    assert extras["errors"] == [0, 0, 1, 0] and extras["format_ok"] == [None, 1.0, None, None]
    assert extras["response_text"] == ["ab", "c", "d", ""]


def test_overlong_penalty_formula():
    # L_max = 20, L_buf = 5: free up to 15 tokens, then linear down to -factor at 20, never below
    assert overlong_penalty(15, 20, 5, 1.0) == 0.0
    assert overlong_penalty(16, 20, 5, 1.0) == pytest.approx(-0.2)
    assert overlong_penalty(20, 20, 5, 0.5) == pytest.approx(-0.5)
    assert overlong_penalty(25, 20, 5, 0.5) == pytest.approx(-0.5)
    rm = RewardManager(FakeTokenizer(), compute_score=lambda *a: 1.0, manager="dapo", overlong=(4, 2, 1.0),
                       log_overlong=True)
    scores, extras = rm(make_batch([[0, 0, 0, 0], [0, 0, 0, 0]], [[1, 1, 0, 0], [1, 1, 1, 1]]))
    assert scores.sum(-1).tolist() == [1.0, 0.0] and extras["overlong_penalty"] == [0.0, -1.0]


def test_default_dispatch_and_unknown_source(tiny_tokenizer):
    rm = RewardManager(tiny_tokenizer)
    ids = tiny_tokenizer("#### 46", add_special_tokens=False)["input_ids"]
    batch = make_batch([ids, ids], [[1] * len(ids)] * 2, sources=["synthetic/arithmetic", "openai/gsm8k"],
                       truths=["46", "47"])
    scores, _ = rm(batch)
    assert scores.sum(-1).tolist() == [1.0, 0.0]
    rm.check_data_sources(["openai/gsm8k", "synthetic/arithmetic"])
    with pytest.raises(KeyError, match="no reward function for data_source 'nope'.*custom_reward_function.path"):
        rm.check_data_sources(["openai/gsm8k", "nope"])
    RewardManager(tiny_tokenizer, compute_score=scorer).check_data_sources(["nope"])  # a custom function takes all
    # the same rows through a worker process: the registered scorers travel with the pool
    pooled = RewardManager(tiny_tokenizer, num_workers=1)
    try:
        assert pooled(batch)[0].sum(-1).tolist() == [1.0, 0.0]
    finally:
        pooled.close()


def test_scorer_acc_is_kept():
    """A scorer's own `acc` wins over `score > 0` (partial credit is not success; DAPO filters on this field);
    rows whose scorer gives no `acc` get `score > 0`."""
    def partial(data_source, solution_str, ground_truth, extra_info):
        return {"score": 0.5, "acc": 0.0} if solution_str == "a" else 1.0

    rm = RewardManager(FakeTokenizer(), compute_score=partial)
    scores, extras = rm(make_batch([[0], [1]], [[1], [1]]))
    assert scores.sum(-1).tolist() == [0.5, 1.0]
    assert extras["acc"] == [0.0, 1.0]


def test_gdpo_manager_adds_the_run_name_to_extra_info():
    """reward_manager=gdpo calls the scorer per response as naive does, with trainer.experiment_name added to each
    row's extra_info as `experiment_name` (verl's gdpo manager; its example scorer picks the chat template by it);
    the row's own dict is left unchanged. `naive` adds nothing."""
    def by_name(data_source, solution_str, ground_truth, extra_info):
        return {"score": float("qwen" in extra_info.get("experiment_name", "")), "seen": float(len(extra_info))}

    own = [{"index": 0}, {}]
    gdpo = RewardManager(FakeTokenizer(), compute_score=by_name, manager="gdpo", experiment_name="qwen3_8b_gdpo")
    scores, extras = gdpo(make_batch([[0], [1]], [[1], [1]], extras=own))
    assert scores.sum(-1).tolist() == [1.0, 1.0] and extras["seen"] == [2.0, 1.0] and own == [{"index": 0}, {}]
    naive = RewardManager(FakeTokenizer(), compute_score=by_name, experiment_name="qwen3_8b_gdpo")
    assert naive(make_batch([[0]], [[1]]))[0].sum().item() == 0.0
    assert load_config(None, ["reward_model.reward_manager=gdpo"]).reward_model.reward_manager == "gdpo"


# ---------------------------------------------------------------- values that are not rewards

NOT_REWARDS = [math.nan, math.inf, -math.inf, None, "1.0", [1.0], {"acc": 1.0}, {"score": math.nan},
               {"score": None}, {"score": 1.0, "acc": math.nan}, np.array([1.0, 2.0])]


@pytest.mark.parametrize("value", NOT_REWARDS, ids=repr)
def test_a_value_that_is_not_a_finite_number_scores_zero_and_is_counted(value):
    rm = RewardManager(FakeTokenizer(), compute_score=faulty_scorers.by_extra)
    batch = rows("len", {"do": "value", "value": value}, {"do": "value", "value": value}, length=3)
    with pytest.warns(RuntimeWarning) as caught:
        scores, extras = rm(batch)
    assert scores.sum(-1).tolist() == [3.0, 0.0, 0.0]
    assert extras["errors"] == [0.0, 1.0, 1.0] and extras["timeouts"] == [0.0, 0.0, 0.0]
    assert torch.isfinite(scores).all()
    messages = [str(w.message) for w in caught]
    assert len(messages) == 1, "logged once, not once per response"
    assert "not a reward" in messages[0] and "response='aaa'" in messages[0]
    shown = repr(value["score"] if isinstance(value, dict) and "score" in value and "acc" not in value else value)
    assert (shown[:20] in messages[0]) or "nan" in messages[0]


@pytest.mark.parametrize("value", [True, 2, np.float32(0.25), torch.tensor(0.5), {"score": np.float64(1.5)}],
                         ids=repr)
def test_numbers_of_other_types_are_rewards(value):
    rm = RewardManager(FakeTokenizer(), compute_score=faulty_scorers.by_extra)
    scores, extras = rm(rows({"do": "value", "value": value}))
    expected = float(value["score"] if isinstance(value, dict) else value)
    assert scores.sum(-1).tolist() == [expected] and extras["errors"] == [0.0]


def test_the_run_stops_when_too_many_responses_fail():
    check_error_rate([1, 0, 0, 0], [0, 1, 0, 0], 0.5)  # 2 of 4 is not more than half
    with pytest.raises(RewardError, match=r"3 of 4 responses .*2 raised.*1 timed out.*max_error_rate=0.5"):
        check_error_rate([1, 1, 0, 0], [0, 0, 1, 0], 0.5)
    check_error_rate([1, 1, 1], [0, 0, 0], 1.0)  # 1 never stops


# ---------------------------------------------------------------- the reward managers

def test_batch_manager_calls_once_with_lists_and_contains_a_wrong_length():
    for workers in (0, 1):
        rm = RewardManager(FakeTokenizer(), compute_score=faulty_scorers.batch_lengths, manager="batch",
                           num_workers=workers)
        try:
            scores, extras = rm(make_batch([[0, 0, 0], [0, 0, 0]], [[1, 1, 1], [1, 1, 0]]))
            assert scores.sum(-1).tolist() == [3.0, 2.0] and extras["errors"] == [0.0, 0.0]
            with pytest.warns(RuntimeWarning, match="returned 1 values for 2 responses"):
                scores, extras = rm(make_batch([[0], [0]], [[1], [1]], extras=[{"short": True}, {}]))
            assert scores.sum(-1).tolist() == [0.0, 0.0] and extras["errors"] == [1.0, 1.0]
        finally:
            rm.close()


def test_batch_manager_takes_an_array_and_checks_each_value():
    rm = RewardManager(FakeTokenizer(), compute_score=lambda **kw: np.array([1.0, np.nan]), manager="batch")
    with pytest.warns(RuntimeWarning, match="nan"):
        scores, extras = rm(make_batch([[0], [0]], [[1], [1]]))
    assert scores.sum(-1).tolist() == [1.0, 0.0] and extras["errors"] == [0.0, 1.0]


def test_manager_choices_in_the_config(tmp_path):
    base = ["algorithm.adv_estimator=gae"]
    assert load_config(None, base + ["reward_model.reward_manager=prime"]).reward_model.reward_manager == "prime"
    assert load_config(None, base).reward_model.num_workers is None  # the default: worker processes
    for bad, message in [("reward_model.reward_manager=prime reward_model.num_workers=0", "prime scores in worker"),
                         ("reward_model.reward_manager=fast", "not one of"),
                         ("reward_model.max_error_rate=1.5", "max_error_rate must lie in"),
                         ("reward_model.num_workers=-1", "num_workers must be >= 0"),
                         ("reward_model.timeout_s=0", "timeout_s must be positive")]:
        with pytest.raises(ConfigError, match=message):
            load_config(None, base + bad.split())
    with pytest.raises(ValueError, match="prime reward manager scores in worker processes"):
        RewardManager(FakeTokenizer(), manager="prime", num_workers=0)
    assert 2 <= auto_workers() <= 8


def test_a_scorer_that_cannot_reach_a_worker_fails_before_scoring():
    with pytest.raises(TypeError, match="cannot be sent to scorer worker processes.*num_workers=0"):
        RewardManager(FakeTokenizer(), compute_score=lambda *a: 1.0, num_workers=1)


# ---------------------------------------------------------------- the worker pool

def test_pool_contains_raise_hang_and_crashes_and_replaces_workers():
    rm = RewardManager(FakeTokenizer(), compute_score=faulty_scorers.by_extra, manager="prime", num_workers=2,
                       timeout_s=1.0)
    try:
        start = time.monotonic()
        with pytest.warns(RuntimeWarning) as caught:
            scores, extras = rm(rows("len", "raise", "hang", "exit", "len", "segfault", "subprocess", "len"))
        took = time.monotonic() - start
        assert scores.sum(-1).tolist() == [2.0, 0.0, 0.0, 0.0, 2.0, 0.0, 42.0, 2.0]
        assert extras["errors"] == [0, 1, 0, 1, 0, 1, 0, 0] and extras["timeouts"] == [0, 0, 1, 0, 0, 0, 0, 0]
        assert rm._pool.replaced == 3  # the hung one and the two that died
        text = "\n".join(str(w.message) for w in caught)
        assert "ValueError: scorer bug" in text and "timeout_s=1" in text and "exit code 3" in text
        assert took < 8, f"one hang should cost about timeout_s, took {took:.1f}s"
        # the same pool goes on with its replaced workers
        scores, extras = rm(rows("len", "len", "len"))
        assert scores.sum(-1).tolist() == [2.0, 2.0, 2.0] and sum(extras["errors"]) == 0
        workers = [w.proc for w in rm._pool._workers]
    finally:
        rm.close()
    assert all(p.poll() is not None for p in workers), "close() leaves no worker behind"


def test_a_replacement_workers_start_up_does_not_count_against_the_time_limit(monkeypatch):
    """A scorer module that takes 1.5 s to import, timeout_s=1: the hung job times out and the jobs after it, sent
    to the replacement worker while it still imports the scorer, score (no cascade of timeouts)."""
    from posttrain.reward.pool import OK, TIMEOUT, ScorerPool

    monkeypatch.setenv("FAULTY_SCORER_IMPORT_S", "1.5")  # read by each worker as it imports faulty_scorers
    pool = ScorerPool(faulty_scorers.by_extra, 1)
    try:
        results = pool.map([("s", "x", "", {"do": "hang"})] + [("s", "abc", "", {})] * 3, timeout_s=1.0)
    finally:
        pool.close()
    assert results == [(TIMEOUT, None)] + [(OK, 3.0)] * 3
    assert pool.replaced == 1


def _gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return True
    return "\nState:\tZ" in state  # a zombie waiting for its reaper is dead too


def test_a_timeout_also_kills_the_processes_the_scorer_started(tmp_path):
    rm = RewardManager(FakeTokenizer(), compute_score=faulty_scorers.by_extra, num_workers=1, timeout_s=1.0)
    pid_file = tmp_path / "pid"
    try:
        with pytest.warns(RuntimeWarning, match="timed out"):
            _, extras = rm(rows({"do": "child_then_hang", "pid_file": str(pid_file)}, "len"))
        assert extras["timeouts"] == [1.0, 0.0]
        pid = int(pid_file.read_text())
        deadline = time.monotonic() + 5
        while not _gone(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _gone(pid)
    finally:
        rm.close()


SIGNALLED_WHILE_STARTING = """
import os, signal, subprocess, sys, time
import faulty_scorers
from posttrain.reward.pool import ScorerPool
noted = []
signal.signal(signal.SIGTERM, lambda *_: noted.append(1))  # a rank notes it and finishes its step
# how a launcher (torch's) signals a rank: its whole process group; here every 0.5 ms, all through the workers' start
me = os.getpid()  # also this process group's id (a session of its own)
storm = subprocess.Popen([sys.executable, "-c", f"import os, signal, time\\nwhile os.getppid() == {me}:\\n"
                          f"    os.killpg({me}, signal.SIGTERM)\\n    time.sleep(0.0005)"],
                         start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
try:
    while not noted:
        time.sleep(0.01)
    pool = ScorerPool(faulty_scorers.by_extra, 4)
    pool.start()
    results = pool.map([("s", "x" * k, "", {}) for k in range(8)], 60.0)
finally:
    storm.kill()
print(bool(noted), results == [("ok", float(k)) for k in range(8)], pool.replaced, results)
pool.close()
"""


def test_a_signal_to_the_ranks_process_group_does_not_reach_starting_workers():
    """A multi-process job's launcher signals each rank's process group; a scorer worker being started must not die
    of it (one did, and the rank then failed sending it the scorer, so the job did not save its step)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(FAULTY.parent), *sys.path])}
    result = subprocess.run([sys.executable, "-c", SIGNALLED_WHILE_STARTING], capture_output=True, text=True,
                            timeout=120, env=env, start_new_session=True)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.startswith("True True 0 "), result.stdout


# ---------------------------------------------------------------- training with a faulty reward function

def _train_overrides(tiny_model_dir, tmp_path, reward_name, steps):
    rows_ = [{"data_source": "faulty", "prompt": [{"role": "user", "content": f"{a}+{a + 3}="}], "ability": "math",
              "reward_model": {"style": "rule", "ground_truth": str(2 * a + 3)}, "extra_info": {"index": a}}
             for a in range(4)]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows_))
    return ["algorithm.adv_estimator=grpo", f"actor_rollout_ref.model.path={tiny_model_dir}",
            f"data.train_files={tmp_path / 'train.jsonl'}", "data.train_batch_size=4", "data.max_prompt_length=64",
            "data.max_response_length=4", "actor_rollout_ref.rollout.n=5", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
            "actor_rollout_ref.model.enable_gradient_checkpointing=False", "actor_rollout_ref.model.dtype=fp32",
            "actor_rollout_ref.rollout.dtype=fp32", f"trainer.total_training_steps={steps}",
            "trainer.logger=['jsonl']", "trainer.val_before_train=False", "trainer.save_freq=-1",
            f"trainer.default_local_dir={tmp_path / 'run'}", f"custom_reward_function.path={FAULTY}",
            f"custom_reward_function.name={reward_name}"]


def test_training_goes_on_through_a_scorer_that_raises_hangs_and_returns_nan(tiny_model_dir, tmp_path, monkeypatch):
    """Default reward settings (the scorer pool, max_error_rate) except a 1 s time limit to keep the test short:
    10% of the calls raise, 5% hang, 10% return NaN; two steps of 20 responses run, the metrics count each exactly
    and nothing that trains is NaN."""
    from posttrain.trainer.rl import RLTrainer

    log = tmp_path / "calls.log"
    monkeypatch.setenv("FAULTY_SCORER_LOG", str(log))
    cfg = load_config(None, _train_overrides(tiny_model_dir, tmp_path, "counted", 2) + ["reward_model.timeout_s=1"])
    assert cfg.reward_model.num_workers is None
    with pytest.warns(RuntimeWarning):
        RLTrainer(cfg).fit()
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2]
    calls = log.read_text().split()
    assert len(calls) == 40 and calls.count("raise") == 4 and calls.count("hang") == 2 and calls.count("nan") == 4
    assert sum(m["reward/errors"] for m in metrics) == 8  # the raises and the NaNs
    assert sum(m["reward/timeouts"] for m in metrics) == 2
    for m in metrics:
        assert all(math.isfinite(v) for v in m.values() if isinstance(v, float)), m


def test_a_run_whose_rewards_all_fail_stops_with_one_line(tiny_model_dir, tmp_path, capsys):
    from posttrain.cli import main

    with pytest.warns(RuntimeWarning, match="not a reward"):
        code = main(["train", *_train_overrides(tiny_model_dir, tmp_path, "always_nan", 2)])
    err = capsys.readouterr().err
    assert code == 1
    assert "reward error: 20 of 20 responses in this step failed to score" in err and "Traceback" not in err
    assert not (tmp_path / "run" / "metrics.jsonl").exists() or not (tmp_path / "run" / "metrics.jsonl").read_text()


def test_a_reward_model_score_that_is_not_finite_is_contained():
    from posttrain.reward.model import ModelRewardManager

    rule = RewardManager(FakeTokenizer(), compute_score=faulty_scorers.by_extra)
    manager = ModelRewardManager(rule, lambda batch: torch.tensor([math.nan, 0.5, math.inf]))
    with pytest.warns(RuntimeWarning, match="reward model gave 2 non-finite scores"):
        scores, extras = manager(rows("len", "len", "len"))
    assert scores.sum(-1).tolist() == [0.0, 0.5, 0.0] and extras["errors"] == [1.0, 0.0, 1.0]


def test_integer_and_bool_reward_extras_are_averaged(tiny_model_dir, tmp_path):
    """A reward extra whose values are ints (a count of characters) or bools (a flag) gets `reward/<name>/mean`,
    the plain mean over the step's responses, like a float extra, whatever type its first value has."""
    from posttrain.trainer.rl import RLTrainer

    trainer = RLTrainer(load_config(None, _train_overrides(tiny_model_dir, tmp_path, "by_extra", 1)
                                    + ["reward_model.num_workers=0"]))
    batch, _ = trainer._training_batch({})
    texts = batch.meta["reward:response_text"]
    batch.meta["reward:chars"] = [len(t) for t in texts]
    batch.meta["reward:short"] = [len(t) < 4 for t in texts]
    batch.meta["reward:mixed"] = [1] + [0.5] * (len(texts) - 1)
    metrics = trainer.learn(batch)
    assert metrics["reward/chars/mean"] == pytest.approx(sum(len(t) for t in texts) / len(texts))
    assert metrics["reward/short/mean"] == pytest.approx(sum(len(t) < 4 for t in texts) / len(texts))
    assert metrics["reward/mixed/mean"] == pytest.approx((1 + 0.5 * (len(texts) - 1)) / len(texts))
    assert "reward/response_text/mean" not in metrics


# ---------------------------------------------------------------- multi-turn episodes


def episode_batch(extra_infos=None):
    """Two episodes (FakeTokenizer: id k is a letter). Row 0: policy 'ab', a tool result 'cd', policy 'e', padding.
    Row 1: policy 'f', then the appended 'gh' of a truncated episode, padding: its last policy token is not its
    last real token."""
    from posttrain.agents.episode import Episode

    episodes = [Episode(prompt_ids=[0], messages=[{"role": "user", "content": "q0"},
                                                  {"role": "assistant", "content": "ab"},
                                                  {"role": "tool", "content": "cd"},
                                                  {"role": "assistant", "content": "e"}]),
                Episode(prompt_ids=[0], messages=[{"role": "user", "content": "q1"},
                                                  {"role": "assistant", "content": "f"},
                                                  {"role": "tool", "content": "gh"}], tool_reward=0.75)]
    tensors = {"responses": torch.tensor([[0, 1, 2, 3, 4, 25], [5, 6, 7, 25, 25, 25]]),
               "response_mask": torch.tensor([[1, 1, 0, 0, 1, 0], [1, 0, 0, 0, 0, 0]]),
               "response_attention_mask": torch.tensor([[1, 1, 1, 1, 1, 0], [1, 1, 1, 0, 0, 0]])}
    meta = {"data_source": ["t", "t"], "ground_truth": ["x", "y"],
            "extra_info": extra_infos if extra_infos is not None else [{"tools_kwargs": {"k": 1}}, None],
            "episode": episodes, "env_reward": [0.25, -1.0]}
    return Batch(tensors, meta)


def test_an_episode_is_scored_on_its_whole_response_and_rewarded_on_its_last_policy_token():
    """The scorer reads every real response token (tool results too) and the conversation in a copy of the row's
    extra_info; the reward (score + env_reward) lands on the last token the policy wrote; overlong shaping counts
    every response token."""
    seen = []

    def recording(data_source, solution_str, ground_truth, extra_info):
        seen.append((solution_str, extra_info))
        return {"abcde": 1.0, "fgh": 0.5}[solution_str]

    infos = [{"tools_kwargs": {"k": 1}}, None]
    batch = episode_batch(infos)
    rm = RewardManager(FakeTokenizer(), compute_score=recording, manager="dapo", overlong=(5, 2, 1.0),
                       log_overlong=True)
    scores, extras = rm(batch)
    assert [s for s, _ in seen] == ["abcde", "fgh"] == extras["response_text"]
    assert seen[0][1] == {"tools_kwargs": {"k": 1}, "messages": batch.meta["episode"][0].messages,
                          "tool_reward": 0.0}
    assert seen[1][1] == {"messages": batch.meta["episode"][1].messages, "tool_reward": 0.75}
    assert infos == [{"tools_kwargs": {"k": 1}}, None]  # the rows' own extra_info are left as they were
    # lengths 5 and 3 (every response token); L_max 5, L_buf 2: free up to 3, then -1/2 per token
    assert extras["overlong_penalty"] == [-1.0, 0.0]
    assert extras["score"] == [1.0, 0.5] and extras["env_reward"] == [0.25, -1.0]
    want = torch.zeros(2, 6)
    want[0, 4] = 1.0 + 0.25 - 1.0  # the last policy token of row 0 is at index 4, not sum(mask) - 1 = 2
    want[1, 0] = 0.5 - 1.0
    assert scores.tolist() == want.tolist()


def test_a_reward_model_scores_the_whole_episode_and_its_reward_lands_on_the_last_policy_token():
    from posttrain.reward.model import ModelRewardManager

    manager = ModelRewardManager(RewardManager(FakeTokenizer()), lambda batch: torch.tensor([2.0, 3.0]))
    manager.check_data_sources(["no-scorer-for-this"])  # the reward model alone scores
    scores, extras = manager(episode_batch())
    assert extras["response_text"] == ["abcde", "fgh"] and extras["score"] == [2.0, 3.0]
    assert scores.nonzero().tolist() == [[0, 4], [1, 0]]
    assert scores[0, 4].item() == 2.25 and scores[1, 0].item() == 2.0


def test_a_single_turn_batch_is_scored_as_before():
    """Without response_attention_mask / episode / env_reward the response is response_mask's tokens and the
    extra_info the row's own object."""
    seen = []
    rm = RewardManager(FakeTokenizer(), compute_score=lambda *a: seen.append(a) or 1.0)
    info = {"k": 1}
    scores, extras = rm(make_batch([[0, 1, 2]], [[1, 1, 0]], extras=[info]))
    assert seen[0][1] == "ab" and seen[0][3] is info and "env_reward" not in extras
    assert scores.tolist() == [[0.0, 1.0, 0.0]]
