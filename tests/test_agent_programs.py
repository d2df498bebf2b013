"""Agent programs as rollouts (agents/trajectories.py, agents/program.py): recorded calls become samples by the
documented merge rule (tokens, masks and log-probs written out by hand here), the response budget holds, and a
program's reward, failures and silences are handled as docs/agents.md says. The server is replaced by a recorder
the test programs write to directly (the HTTP path is tested with the server itself)."""

from __future__ import annotations

import contextlib
import json
import math
import sys
import threading
from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch

from posttrain.agents.episode import Episode
from posttrain.agents.program import ProgramRunner, printed_reward
from posttrain.agents.rollout import episodes_batch, require_samples, run_episodes
from posttrain.agents.settings import AgentSettings
from posttrain.agents.trajectories import trajectories
from posttrain.config import ConfigError, load_config
from posttrain.data.batch import Batch
from posttrain.reward.manager import RewardManager
from posttrain.rollout.base import SamplingParams

E = 99  # the end-of-turn token of the hand-made calls


@dataclass
class Call:
    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    finish_reason: str = "stop"


def lp(*values):
    return [float(v) for v in values]


# ---------------------------------------------------------------- the merge rule


def test_a_call_that_continues_the_conversation_extends_its_trajectory():
    calls = [Call([1, 2, 3], [10, 11, E], lp(-0.1, -0.2, -0.3)),
             Call([1, 2, 3, 10, 11, E, 20, 21, 22], [12, E], lp(-0.4, -0.5)),
             Call([1, 2, 3, 10, 11, E, 20, 21, 22, 12, E, 30], [13], lp(-0.6), "length")]
    [ep] = trajectories(calls, budget=100)
    assert ep.prompt_ids == [1, 2, 3]
    assert ep.tokens == [10, 11, E, 20, 21, 22, 12, E, 30, 13]
    assert ep.mask == [1, 1, 1, 0, 0, 0, 1, 1, 0, 1]
    assert ep.logprobs == [-0.1, -0.2, -0.3, 0.0, 0.0, 0.0, -0.4, -0.5, 0.0, -0.6]
    assert ep.assistant_turns == 3 and not ep.truncated


def test_a_call_that_does_not_continue_starts_a_new_sample():
    calls = [Call([1, 2, 3], [10, E], lp(-1, -2)),
             Call([1, 2, 4, 10, E, 20], [11, E], lp(-3, -4)),  # another prompt
             Call([1, 2, 3], [12, E], lp(-5, -6))]  # the same prompt again: a new sample, not a continuation
    eps = trajectories(calls, budget=100)
    assert [(e.prompt_ids, e.tokens, e.mask, e.logprobs) for e in eps] == [
        ([1, 2, 3], [10, E], [1, 1], [-1.0, -2.0]),
        ([1, 2, 4, 10, E, 20], [11, E], [1, 1], [-3.0, -4.0]),
        ([1, 2, 3], [12, E], [1, 1], [-5.0, -6.0])]


def test_a_rewritten_history_starts_a_sample_and_interleaved_conversations_stay_apart():
    calls = [Call([1, 2], [10, E], lp(-1, -1)),
             Call([1, 2, 10, 77, 20], [11, E], lp(-2, -2)),  # the program edited the answer: history rewritten
             Call([1, 2, 10, 77, 20, 11, E, 21], [12, E], lp(-3, -3)),  # continues the rewritten one
             Call([1, 2, 10, E, 22], [13, E], lp(-4, -4))]  # continues the first conversation
    first, second = trajectories(calls, budget=100)
    assert (first.prompt_ids, first.tokens, first.mask) == ([1, 2], [10, E, 22, 13, E], [1, 1, 0, 1, 1])
    assert first.logprobs == [-1.0, -1.0, 0.0, -4.0, -4.0]
    assert (second.prompt_ids, second.tokens, second.mask) == ([1, 2, 10, 77, 20], [11, E, 21, 12, E],
                                                               [1, 1, 0, 1, 1])


def test_no_call_is_no_sample_and_a_sample_needs_a_policy_token():
    assert trajectories([], budget=10) == []
    assert trajectories([Call([1, 2], [], [], "error")], budget=10) == []


def test_the_response_budget_cuts_completions_and_ends_trajectories():
    # a completion past the budget is cut; a call that continues the cut trajectory adds nothing
    calls = [Call([1], [10, 11, 12, 13, 14, E], lp(-1, -2, -3, -4, -5, -6)),
             Call([1, 10, 11, 12, 13, 14, E, 20], [15, E], lp(-7, -8))]
    [ep] = trajectories(calls, budget=4)
    assert (ep.tokens, ep.mask, ep.logprobs, ep.truncated) == ([10, 11, 12, 13], [1] * 4, lp(-1, -2, -3, -4), True)
    # appended tokens that would reach the budget end the trajectory without them
    calls = [Call([1], [10, E], lp(-1, -2)), Call([1, 10, E, 20, 21, 22], [11, E], lp(-3, -4))]
    [ep] = trajectories(calls, budget=5)
    assert (ep.tokens, ep.truncated) == ([10, E], True)
    # room for the appended tokens and part of the completion
    [ep] = trajectories(calls, budget=6)
    assert (ep.tokens, ep.mask, ep.truncated) == ([10, E, 20, 21, 22, 11], [1, 1, 0, 0, 0, 1], True)
    # exactly at the budget: not truncated
    [ep] = trajectories(calls, budget=7)
    assert (len(ep.tokens), ep.truncated) == (7, False)


def test_calls_with_mismatched_logprobs_are_refused():
    with pytest.raises(ValueError, match="2 completion ids but 1 log-probs"):
        trajectories([Call([1], [10, E], lp(-1))], budget=10)


# ---------------------------------------------------------------- the runner (server replaced)


class Recorder:
    def __init__(self):
        self.calls, self.rewards, self.lock = {}, {}, threading.Lock()

    def record(self, episode, call):
        with self.lock:
            self.calls.setdefault(episode, []).append(call)

    def set_reward(self, episode, reward):
        self.rewards[episode] = reward

    def take(self, episode):
        with self.lock:
            return self.calls.pop(episode, []), self.rewards.pop(episode, None)

    def counts(self):
        return {}


RECORDERS: dict[str, Recorder] = {}


@contextlib.contextmanager
def fake_serve(engine, tokenizer, sampling, programs):
    recorder = Recorder()
    RECORDERS["fake"] = recorder
    yield "fake", recorder


def answer(row, api_key, *tokens, prompt=(1, 2)):
    """One call of `row`'s program: the completion `tokens`."""
    RECORDERS["fake"].record(api_key, Call(list(prompt), list(tokens), [-0.5] * len(tokens)))


def runner_for(program, tokenizer, **settings):
    engine = SimpleNamespace(pad_id=0)
    return ProgramRunner(engine, tokenizer, AgentSettings(**settings), program, serve=fake_serve)


ROWS = [{"uid": "a", "data_source": "d", "ground_truth": "1", "prompt": [{"role": "user", "content": "x"}]},
        {"uid": "b", "data_source": "d", "ground_truth": "2", "prompt": [{"role": "user", "content": "y"}]}]


def test_rewards_come_from_the_program_then_the_posted_reward_then_the_scorer(tiny_tokenizer):
    def program(row, base_url, api_key):
        assert base_url == "fake" and api_key.startswith("episode-")
        answer(row, api_key, 5, 6)
        if row["uid"] == "a":
            return 0.75
        RECORDERS["fake"].set_reward(api_key, 0.25)
        return None if row["uid"] == "b" else 0.0

    rows = ROWS + [{"uid": "c", "data_source": "d", "ground_truth": "3"}]

    def quiet(row, base_url, api_key):
        answer(row, api_key, 7)
        return 1.0 if row["uid"] == "a" else None

    eps = runner_for(program, tiny_tokenizer).run(rows[:2], 2, SamplingParams(n=2, max_new_tokens=8))
    assert [(e.row["uid"], e.reward) for e in eps] == [("a", 0.75), ("a", 0.75), ("b", 0.25), ("b", 0.25)]
    eps = runner_for(quiet, tiny_tokenizer).run(rows, 1, SamplingParams(max_new_tokens=8))
    assert [(e.row["uid"], e.reward) for e in eps] == [("a", 1.0), ("b", None), ("c", None)]


def test_failing_and_silent_programs_give_no_sample_and_are_counted(tiny_tokenizer):
    def program(row, base_url, api_key):
        answer(row, api_key, 5, E)
        kind = row["kind"]
        if kind == "raises":
            raise RuntimeError("the program broke")
        if kind == "nan":
            return math.nan
        if kind == "text":
            return "1.0"
        if kind == "hangs":
            threading.Event().wait(5)
        if kind == "silent":
            RECORDERS["fake"].calls.pop(api_key)
        return 1.0

    kinds = ["ok", "raises", "nan", "text", "hangs", "silent", "ok"]
    rows = [{"uid": f"r{i}", "kind": k, "data_source": "d"} for i, k in enumerate(kinds)]
    runner = runner_for(program, tiny_tokenizer, program_timeout_s=0.5, num_workers=2)
    with pytest.warns(RuntimeWarning) as caught:
        eps = runner.run(rows, 1, SamplingParams(max_new_tokens=8))
    assert [e.row["uid"] for e in eps] == ["r0", "r6"]
    assert runner.take_metrics() == {"agent/programs": 7.0, "agent/program_errors": 4.0,
                                     "agent/program_errors/raised": 1.0, "agent/program_errors/bad_reward": 2.0,
                                     "agent/program_errors/timeout": 1.0, "agent/program_no_calls": 1.0,
                                     "agent/program_samples": 2.0, "agent/program_scored_by_reward_function": 0.0}
    assert runner.take_metrics() == {}
    messages = " ".join(str(w.message) for w in caught)
    assert "RuntimeError: the program broke" in messages and "program_timeout_s=0.5" in messages


COMMAND = """
import json, os, sys
row = json.load(sys.stdin)
assert os.environ["OPENAI_API_KEY"].startswith("episode-") and os.environ["OPENAI_BASE_URL"] == "fake"
kind = row["kind"]
print("a log line")
if kind == "exit": sys.exit(3)
if kind == "hang": import time; time.sleep(30)
if kind == "garbage": print('{"reward": "high"}')
if kind == "ok": print(json.dumps({"reward": 0.5}))
"""


def test_commands_get_the_row_on_stdin_and_print_their_reward(tiny_tokenizer, tmp_path):
    script = tmp_path / "agent.py"
    script.write_text(COMMAND)

    @contextlib.contextmanager
    def serve_one_call_each(engine, tokenizer, sampling, programs):  # every episode id made one call
        recorder = Recorder()
        recorder.take = lambda key: ([Call([1], [5, E], [-1.0, -1.0])], None)
        yield "fake", recorder

    runner = ProgramRunner(SimpleNamespace(pad_id=0), tiny_tokenizer, AgentSettings(program_timeout_s=3),
                           f"{sys.executable} {script}", serve=serve_one_call_each)
    rows = [{"uid": k, "kind": k} for k in ("ok", "none", "exit", "hang", "garbage")]
    with pytest.warns(RuntimeWarning):
        eps = runner.run(rows, 1, SamplingParams(max_new_tokens=8))
    assert [(e.row["uid"], e.reward) for e in eps] == [("ok", 0.5), ("none", None)]
    counts = runner.take_metrics()
    assert {k: counts[k] for k in counts if k.startswith("agent/program_errors/")} == {
        "agent/program_errors/exit_status": 1.0, "agent/program_errors/timeout": 1.0,
        "agent/program_errors/bad_reward": 1.0}


def test_printed_rewards_are_the_last_line_when_it_is_a_reward_object():
    assert printed_reward('log\n{"reward": 1}\n\n').reward == 1.0
    assert printed_reward('{"reward": 1}\nlast words').reward is None
    assert printed_reward("").reward is None and printed_reward("[1]").reward is None
    assert printed_reward('{"reward": null}').error is None
    assert printed_reward('{"reward": "inf"}').error == "bad_reward"
    assert printed_reward('{"reward": true}').error == "bad_reward"


# ---------------------------------------------------------------- into the training batch


def test_a_row_gives_as_many_samples_as_its_program_made_all_under_its_uid(tiny_tokenizer):
    def program(row, base_url, api_key):
        if row["uid"] == "a":  # two conversations: two samples
            answer(row, api_key, 5, E, prompt=(1, 2))
            answer(row, api_key, 6, 7, E, prompt=(3, 4, 4))
        return 1.0

    batch = Batch({"prompts": torch.zeros(2, 3, dtype=torch.long)},
                  {"uid": ["a", "b"], "data_source": ["d", "d"], "raw_prompt": [None, None]})
    runner = runner_for(program, tiny_tokenizer)
    out = run_episodes(runner, batch, SamplingParams(n=1, max_new_tokens=8, logprobs=True))
    assert out.meta["uid"] == ["a", "a"]
    assert out["prompts"].tolist() == [[0, 1, 2], [3, 4, 4]]
    assert out["responses"].tolist() == [[5, E, 0], [6, 7, E]]
    assert out["response_mask"].tolist() == [[1, 1, 0], [1, 1, 1]]
    assert out["rollout_log_probs"].tolist() == [[-0.5, -0.5, 0.0], [-0.5, -0.5, -0.5]]
    # no sample on this rank: a batch of no row with the same fields (other ranks may have samples); no sample
    # gathered from any rank: an error
    empty = run_episodes(runner_for(lambda row, url, key: 1.0, tiny_tokenizer), batch,
                         SamplingParams(max_new_tokens=8, logprobs=True))
    assert len(empty) == 0 and set(empty.tensors) == set(out.tensors) and empty["responses"].shape == (0, 1)
    assert require_samples(out, 2) is out
    with pytest.raises(RuntimeError, match="no sample on any rank from the episodes of this step's 2 prompts"):
        require_samples(empty, 2)


def test_a_program_reward_replaces_the_scorer_for_its_sample(tiny_tokenizer):
    scored = []

    def score(data_source, text, truth, extra_info):
        scored.append(truth)
        return 0.25

    eps = [Episode(prompt_ids=[1], messages=[], tokens=[5, 6], mask=[1, 1], logprobs=[0.0, 0.0], reward=r)
           for r in (0.75, None, 0.0)]
    meta = {"data_source": ["d"] * 3, "ground_truth": ["x", "y", "z"], "extra_info": [{}] * 3}
    batch = episodes_batch(Batch({}, meta), eps, 0, logprobs=False)
    token_scores, extras = RewardManager(tiny_tokenizer, compute_score=score)(batch)
    assert scored == ["y"]
    assert extras["score"] == [0.75, 0.25, 0.0]
    assert token_scores.sum(-1).tolist() == [0.75, 0.25, 0.0]


# ---------------------------------------------------------------- config


def program_module(tmp_path, monkeypatch):
    (tmp_path / "my_agent.py").write_text("def play(row, base_url, api_key):\n    return 1.0\nNUMBER = 3\n")
    (tmp_path / "broken_agent.py").write_text("import no_such_package_here\n")
    monkeypatch.syspath_prepend(str(tmp_path))


def test_a_program_that_does_not_import_is_refused_when_the_config_loads(tmp_path, monkeypatch):
    program_module(tmp_path, monkeypatch)
    key = "actor_rollout_ref.rollout.agent.program"
    cases = [("broken_agent:play", "importing broken_agent failed: ModuleNotFoundError"),
             ("my_agent:missing", "my_agent has no 'missing'"),
             ("my_agent:NUMBER", "NUMBER is a int, not a function"),
             (f"{tmp_path}/nowhere.py:play", "no file"),
             ("' '", "is empty")]
    for spec, fragment in cases:
        with pytest.raises(ConfigError, match=fragment):
            load_config(None, [f"{key}={spec}"])
    with pytest.raises(ConfigError, match="rollout.name=hf"):
        load_config(None, [f"{key}=my_agent:play", "actor_rollout_ref.rollout.name=hf"])
    with pytest.raises(ConfigError, match="adv_estimator=remax: its greedy baseline"):
        load_config(None, [f"{key}=my_agent:play", "algorithm.adv_estimator=remax"])
    with pytest.raises(ConfigError, match="program_timeout_s=0.0 must be positive"):
        load_config(None, ["actor_rollout_ref.rollout.agent.program_timeout_s=0"])
    for spec in ("my_agent:play", f"{tmp_path}/my_agent.py:play", "python3 agent.py --flag"):
        cfg = load_config(None, [f"{key}={spec}"])
        assert AgentSettings.from_config(cfg).program == spec
    runner = ProgramRunner(None, None, AgentSettings(program=f"{tmp_path}/my_agent.py:play"))
    assert runner.program({}, "", "") == 1.0
    assert ProgramRunner(None, None, AgentSettings(program="python3 agent.py --flag")).program == [
        "python3", "agent.py", "--flag"]


# ---------------------------------------------------------------- through the real server


def reference_greedy(lm, prompt: list[int], steps: int, eos: int) -> list[int]:
    """Greedy decoding by the model's own forward over the whole sequence each step; stops after EOS."""
    ids, out = list(prompt), []
    with torch.no_grad():
        for _ in range(steps):
            token = int(lm(input_ids=torch.tensor([ids])).logits[0, -1].argmax())
            out.append(token)
            ids.append(token)
            if token == eos:
                break
    return out


def test_a_program_over_the_server_trains_on_what_the_policy_decoded(tiny_model_dir):
    """Two chat calls of an openai-client program, the second going on from the first's answer, through the real
    server: the sample's prompt is the rendered chat, its policy tokens the model's greedy tokens with finite
    log-probs, and the second call continues the sample (appended: the rest of the re-rendered conversation) exactly
    when its rendered prompt starts with the first call's prompt and answer; the reward is the one POSTed."""
    import httpx
    import openai

    from posttrain.models.load import load_causal_lm, load_tokenizer
    from posttrain.models.policy import PolicyModel
    from posttrain.rollout.registry import build_engine

    tok = load_tokenizer(str(tiny_model_dir))
    engine = build_engine("posttrain", PolicyModel(load_causal_lm(str(tiny_model_dir))), tok,
                          device=torch.device("cpu"), dtype=torch.float32)
    lm = load_causal_lm(str(tiny_model_dir)).eval()
    sent = {}

    def program(row, base_url, api_key):
        client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
        messages = list(row["prompt"])
        first = client.chat.completions.create(model="policy", messages=messages, max_tokens=6, temperature=1.3)
        messages += [{"role": "assistant", "content": first.choices[0].message.content},
                     {"role": "user", "content": "and 5+5="}]
        client.chat.completions.create(model="policy", messages=messages, max_tokens=6)
        sent[row["uid"]] = messages
        httpx.post(base_url.removesuffix("/v1") + "/rl/reward", json={"reward": 0.5},
                   headers={"Authorization": f"Bearer {api_key}"}).raise_for_status()

    rows = [{"uid": "a", "prompt": [{"role": "user", "content": "2+3="}]},
            {"uid": "b", "prompt": [{"role": "user", "content": "7+1="}]}]
    runner = ProgramRunner(engine, tok, AgentSettings(num_workers=4), program)
    eps = runner.run(rows, 1, SamplingParams(do_sample=False, max_new_tokens=64, logprobs=True))
    assert runner.take_metrics() == {"agent/programs": 2.0, "agent/program_samples": float(len(eps)),
                                     "agent/program_scored_by_reward_function": 0.0}
    def render(messages):
        ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)

    eos = tok.eos_token_id
    for row in rows:
        mine = [e for e in eps if e.row is row]
        prompt = render(row["prompt"])
        first = reference_greedy(lm, prompt, 6, eos)
        second_prompt = render(sent[row["uid"]])
        second = reference_greedy(lm, second_prompt, 6, eos)
        assert mine[0].prompt_ids == prompt and mine[0].tokens[:len(first)] == first
        assert all(e.reward == 0.5 for e in mine)
        if second_prompt[:len(prompt) + len(first)] == prompt + first:
            gap = second_prompt[len(prompt) + len(first):]
            [ep] = mine
            assert ep.tokens == first + gap + second
            assert ep.mask == [1] * len(first) + [0] * len(gap) + [1] * len(second)
        else:
            assert [(e.prompt_ids, e.tokens) for e in mine] == [(prompt, first), (second_prompt, second)]
        for ep in mine:
            policy = [lp for lp, m in zip(ep.logprobs, ep.mask) if m]
            assert all(math.isfinite(lp) and lp <= 0 for lp in policy) and len(ep.logprobs) == len(ep.tokens)


def test_seeds_that_programs_send_are_dropped_in_training_and_counted(tiny_model_dir):
    """Runs of one row that all send the same seed would draw the same sample (a group without variance): the
    training server drops client seeds, and the rollout's metrics count each dropped one."""
    import openai

    from posttrain.models.load import load_causal_lm, load_tokenizer
    from posttrain.models.policy import PolicyModel
    from posttrain.rollout.registry import build_engine

    tok = load_tokenizer(str(tiny_model_dir))
    engine = build_engine("posttrain", PolicyModel(load_causal_lm(str(tiny_model_dir))), tok,
                          device=torch.device("cpu"), dtype=torch.float32)

    def program(row, base_url, api_key):
        client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
        client.chat.completions.create(model="policy", messages=row["prompt"], max_tokens=4, seed=7)
        return 1.0

    runner = ProgramRunner(engine, tok, AgentSettings(num_workers=3), program)
    runner.run([{"uid": "a", "prompt": [{"role": "user", "content": "2+3="}]}], 3,
               SamplingParams(do_sample=True, temperature=1.0, max_new_tokens=8, logprobs=True))
    assert runner.take_metrics()["agent/server_seeds_dropped"] == 3.0


# ------------------------------------------------------------------ posttrain eval with agent programs

EXAMPLES = __import__("pathlib").Path(__file__).resolve().parents[1] / "examples"


def known_reward_program(row, base_url, api_key):
    """One call to the server; reward 1 on the held-out rows of even index, else 0."""
    from openai import OpenAI

    OpenAI(base_url=base_url, api_key=api_key, max_retries=0).chat.completions.create(
        model="policy", messages=row["prompt"], max_tokens=2)
    return float(row["extra_info"]["index"] % 2 == 0)


def failing_on_odd_rows_program(row, base_url, api_key):
    """Reward 1 on the held-out rows of even index; the runs of odd rows fail."""
    if row["extra_info"]["index"] % 2:
        raise RuntimeError("this run fails")
    return known_reward_program(row, base_url, api_key)


def test_eval_runs_agent_programs_on_the_eval_rows_and_reports_their_accuracy(tiny_model_dir, tmp_path):
    """`posttrain eval --program` plays each held-out row of the tool task with the program, as training does: the
    calculator agent's runs are counted and each sample carries its conversation; a program whose rewards are known
    (1 on even rows) gives exactly that accuracy, so the accuracy is the program's reward, not a single response's."""
    from posttrain.data.synthetic_tools import write_task
    from posttrain.trainer.evaluate import EvalArgs, run_eval

    test = write_task(tmp_path / "task", train=2, dev=0, held_out=3)["test"]
    common = dict(model=str(tiny_model_dir), data_files=[str(test)], max_new_tokens=8, num_workers=0, quiet=True)
    out = tmp_path / "calculator.jsonl"
    metrics = run_eval(EvalArgs(**common, output=str(out),
                                program=f"{EXAMPLES}/agent_programs/calculator_agent.py:run"))
    assert metrics["val-agent/programs"] == 3
    samples = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(samples) == metrics["val-agent/program_samples"]
    assert all(s["messages"][-1]["role"] == "assistant" and s["score"] in (0.0, 1.0) for s in samples)
    assert metrics["val-core/synthetic/calculator/acc/mean@1"] == pytest.approx(
        sum(s["score"] for s in samples) / len(samples))

    known = run_eval(EvalArgs(**common, output=str(tmp_path / "known.jsonl"),
                              program=f"{__file__}:known_reward_program"))
    assert known["val-core/synthetic/calculator/acc/mean@1"] == pytest.approx(2 / 3)  # rows 0 and 2 of 3
    assert known["val-agent/programs"] == 3 and known["val-agent/program_samples"] == 3

    # a failed run counts as a wrong answer: 2 of 3 rows right, not 2 of the 2 that gave a sample
    failing = run_eval(EvalArgs(**common, output=str(tmp_path / "failing.jsonl"),
                                program=f"{__file__}:failing_on_odd_rows_program"))
    assert failing["val-core/synthetic/calculator/acc/mean@1"] == pytest.approx(2 / 3)
    assert failing["val-agent/program_errors"] == 1
    rows = [json.loads(line) for line in (tmp_path / "failing.jsonl").read_text().splitlines()]
    assert [r.get("failed", False) for r in sorted(rows, key=lambda r: r["index"])] == [False, True, False]


def test_eval_refuses_programs_with_the_loop_s_flags_or_without_their_data(tmp_path):
    from posttrain.trainer.evaluate import EvalArgs, check_eval_args

    data = tmp_path / "rows.jsonl"
    data.write_text("{}\n")
    with pytest.raises(ConfigError, match="--tool-config with --program: these set up posttrain's episode loop"):
        check_eval_args(EvalArgs(model="m", data_files=[str(data)], program="x.y:z", tool_config_path=str(data)))
    with pytest.raises(ConfigError) as e:
        check_eval_args(EvalArgs(model="m", data_files=[str(data)], environment="verifiers:x"))
    assert "--environment with --data" in str(e.value) and "--environment needs --max-samples" in str(e.value)
    with pytest.raises(ConfigError, match="--program: .*no_such_module"):
        check_eval_args(EvalArgs(model="m", data_files=[str(data)], program="no_such_module:play"))
