"""The episode loop against its definition: each policy turn is what the model samples after the whole conversation
so far (a full forward over prompt + every earlier token, no cache), appended tokens are the chat template's delta of
the environment's messages, the mask is 1 exactly on sampled tokens, and the budget, turn limits and failing
environments end episodes as documented. Environments here are scripted; the model is the tiny one with random
weights, and turns end on a set of common tokens so that they end within a few tokens."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from posttrain.agents.environment import Reset, Step
from posttrain.agents.loop import EpisodeRunner
from posttrain.agents.rollout import episodes_batch
from posttrain.agents.settings import AgentSettings
from posttrain.agents.template import Template, render
from posttrain.data.batch import Batch
from posttrain.rollout.base import SamplingParams
import posttrain.rollout.decode_state as decode_state
from posttrain.rollout.decode_state import DecodeState
from posttrain.rollout.engine import DecodeEngine

PROMPTS = [[{"role": "user", "content": "Add 2 and 3."}], [{"role": "user", "content": "What is 7 times 6?"}]]


class Scripted:
    """Answers each turn with a tool message naming the episode and turn, `turns` times, then ends; `slow`: the
    first answer takes that long; `fail`: raises at that turn; `log`: (time, episode key, turn) of each answer."""

    def __init__(self, turns=2, slow=0.0, fail=None, hang=None, log=None, role="tool", reward=0.25):
        self.turns, self.slow, self.fail, self.hang, self.log, self.role, self.reward = \
            turns, slow, fail, hang, log, role, reward
        self.seen = 0

    def reset(self, row):
        self.key = row["uid"]
        return Reset(messages=row["prompt"])

    def step(self, episode):
        self.seen += 1
        if self.slow and self.seen == 1:
            time.sleep(self.slow)
        if self.hang is not None and self.seen == self.hang:
            threading.Event().wait(5)
        if self.fail is not None and self.seen == self.fail:
            raise RuntimeError("scripted failure")
        if self.log is not None:
            self.log.append((time.monotonic(), self.key, self.seen))
        if self.seen > self.turns:
            return Step(done=True, reward=1.0)
        return Step(messages=[{"role": self.role, "content": f"result {self.key} {self.seen}"}], reward=self.reward)

    def close(self):
        pass


def runner_for(lm, tok, factory, **settings):
    engine = DecodeEngine(lm, tok, device=torch.device("cpu"), dtype=torch.float32)
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    runner = EpisodeRunner(engine, tok, AgentSettings(**{"tokenization_sanity_check_mode": "disable", **settings}),
                           environments=factory)
    runner.template = Template(tok, {im_end})  # the template's own end-of-turn token
    engine.eos_ids = {t for t in range(len(tok)) if t % 5 == 0} | {im_end}  # turns end within a few tokens
    return runner, engine


def rows():
    return [{"uid": f"p{i}", "prompt": m} for i, m in enumerate(PROMPTS)]


def reference_turn(lm, context: list[int], eos: set[int], limit: int) -> list[int]:
    """Greedy tokens after `context` by full forwards, up to and including an end-of-turn token."""
    out = []
    while len(out) < limit:
        with torch.no_grad():
            logits = lm(input_ids=torch.tensor([context + out])).logits[0, -1]
        out.append(int(logits.argmax()))
        if out[-1] in eos:
            break
    return out


GREEDY = SamplingParams(n=2, do_sample=False, max_new_tokens=150)


def test_each_turn_is_the_model_s_greedy_continuation_of_the_whole_conversation(lm, tiny_tokenizer, monkeypatch):
    """Also across the decoding state's dropping of suffix columns no live row reads (it happens in this run)."""
    dropped = []
    drop = DecodeState._drop_unread_columns

    def counting(state):
        drop(state)
        dropped.append(state.columns_dropped)
    monkeypatch.setattr(DecodeState, "_drop_unread_columns", counting)
    monkeypatch.setattr(decode_state, "DROP_COLUMNS_MIN", 1)
    monkeypatch.setattr(decode_state, "FIRST_CAPACITY", 4)
    runner, engine = runner_for(lm, tiny_tokenizer, lambda row: Scripted())
    episodes = runner.run(rows(), 2, GREEDY)
    assert max(dropped) > 0
    assert len(episodes) == 4
    for ep in episodes:
        spans, i = [], 0
        while i < len(ep.tokens):  # split into alternating policy / appended spans
            j = i
            while j < len(ep.tokens) and ep.mask[j] == ep.mask[i]:
                j += 1
            spans.append((ep.mask[i], i, j))
            i = j
        assert spans[0][0] == 1
        for m, i, j in spans:
            if m == 1:
                want = reference_turn(lm, ep.prompt_ids + ep.tokens[:i], engine.eos_ids, GREEDY.max_new_tokens - i)
                assert ep.tokens[i:j] == want
        turns = sum(1 for m, _, _ in spans if m == 1)
        assert ep.assistant_turns == turns
        if not ep.truncated:
            assert turns == 3 and ep.env_reward == pytest.approx(0.25 * 2 + 1.0)
        assert len(ep.tokens) <= GREEDY.max_new_tokens
    assert sum(not ep.truncated for ep in episodes) >= 2  # the budget leaves room for whole episodes


def test_appended_tokens_are_the_template_s_delta_of_the_environment_s_messages(lm, tiny_tokenizer):
    runner, engine = runner_for(lm, tiny_tokenizer, lambda row: Scripted(turns=1))
    ep = runner.run(rows()[:1], 1, SamplingParams(n=1, do_sample=False, max_new_tokens=60))[0]
    start = ep.mask.index(0)
    end = start + ep.mask[start:].index(1)
    appended = ep.tokens[start:end]
    # re-derived: "<|im_end|>" ends the policy's turn; then the template writes "\n", the tool turn, and the next
    # assistant generation prompt
    text = tiny_tokenizer.decode(appended)
    assert text == "\n<|im_start|>tool\nresult p0 1<|im_end|>\n<|im_start|>assistant\n"
    assert ep.messages[-2] == {"role": "tool", "content": "result p0 1"}


def test_continuous_and_turn_by_turn_loops_give_the_same_episodes(lm, tiny_tokenizer):
    runner, _ = runner_for(lm, tiny_tokenizer, lambda row: Scripted())
    a = runner.run(rows(), 2, GREEDY)
    b = runner.run(rows(), 2, GREEDY, continuous=False)
    assert [e.tokens for e in a] == [e.tokens for e in b]
    assert [e.mask for e in a] == [e.mask for e in b]


def test_sampled_turns_keep_the_log_prob_each_token_was_drawn_with(lm, tiny_tokenizer):
    runner, engine = runner_for(lm, tiny_tokenizer, lambda row: Scripted())
    torch.manual_seed(3)
    s = SamplingParams(n=2, temperature=1.0, max_new_tokens=30, logprobs=True)
    for ep in runner.run(rows(), 2, s):
        for t, (token, m, lp) in enumerate(zip(ep.tokens, ep.mask, ep.logprobs)):
            if not m:
                assert lp == 0.0
                continue
            with torch.no_grad():
                logits = lm(input_ids=torch.tensor([ep.prompt_ids + ep.tokens[:t]])).logits[0, -1].double()
            assert lp == pytest.approx(float(torch.log_softmax(logits, -1)[token]), abs=1e-4)



@pytest.mark.parametrize("continuous", [True, False])
def test_weights_swapped_between_decoding_steps_label_each_token_with_the_oldest_weights_it_attended_to(
        lm, tiny_tokenizer, continuous):
    """Partial rollouts in both loops: the engine's `between_steps` hook runs before every forward and names a new
    version each time; the weights it swaps in at its 3rd call sample the tokens after it, over keys and values the
    old weights computed. Each policy token's version is the oldest weights among what it attended to: the version
    of the forward that computed its episode's prompt (the continuous loop keeps every key), or its turn's prefill
    (the turn-by-turn loop recomputes the conversation each turn) — not the newer version that sampled it. Each
    token's log-prob is the plain forward's under the weights that sampled it (the swap changes the last layer's
    output projection, which no cached key or value depends on), and the staleness metrics count the labels."""
    import copy

    from posttrain.algo.staleness import staleness_metrics

    new = copy.deepcopy(lm)
    target = new.model.layers[1].mlp.down_proj.weight
    with torch.no_grad():
        target.add_(0.05 * torch.randn(target.shape, generator=torch.Generator().manual_seed(1)))
    runner, engine = runner_for(copy.deepcopy(lm), tiny_tokenizer, lambda row: Scripted())
    calls = []

    def between_steps(decoding):
        calls.append(1)
        if len(calls) == 3:
            decoding.model.layers[1].mlp.down_proj.weight.copy_(target)
        return len(calls)

    engine.between_steps = between_steps
    torch.manual_seed(3)
    s = SamplingParams(n=2, temperature=1.0, max_new_tokens=40, logprobs=True)
    swapped_under_old_keys = 0
    for ep in runner.run(rows(), 2, s, continuous=continuous):
        assert all(v == 0 for v, m in zip(ep.versions, ep.mask) if not m)
        turns = [(i, j) for i, j in _spans(ep.mask) if ep.mask[i]]
        if continuous:
            assert {ep.versions[t] for i, j in turns for t in range(i, j)} == {1}  # the prompts' prefill
        else:
            firsts = [ep.versions[i] for i, _ in turns]
            assert all(len({ep.versions[t] for t in range(i, j)}) == 1 for i, j in turns)
            assert firsts == sorted(firsts) and len(set(firsts)) == len(firsts)  # a new prefill each turn
        for t, (token, m, lp, v) in enumerate(zip(ep.tokens, ep.mask, ep.logprobs, ep.versions)):
            if not m:
                continue
            with torch.no_grad():
                old_lp, new_lp = (float(torch.log_softmax(w(input_ids=torch.tensor([ep.prompt_ids + ep.tokens[:t]]))
                                                          .logits[0, -1].double(), -1)[token]) for w in (lm, new))
            assert lp == pytest.approx(old_lp, abs=1e-4) or lp == pytest.approx(new_lp, abs=1e-4)
            swapped_under_old_keys += v < 3 and lp == pytest.approx(new_lp, abs=1e-4) and abs(old_lp - new_lp) > 1e-3
        batch = episodes_batch(Batch({}, {}), [ep], engine.pad_id, logprobs=True, versions=True)
        assert batch["rollout_versions"].tolist() == [[v * m for v, m in zip(ep.versions, ep.mask)]]
        metrics = staleness_metrics(batch["rollout_versions"], batch["response_mask"], trainer_version=len(calls))
        assert metrics["async/staleness_max"] == len(calls) - min(v for v, m in zip(ep.versions, ep.mask) if m)
    assert len(calls) > 3 and swapped_under_old_keys > 0  # new weights over old keys: labelled old


def _spans(mask: list[int]) -> list[tuple[int, int]]:
    spans, i = [], 0
    while i < len(mask):
        j = i
        while j < len(mask) and mask[j] == mask[i]:
            j += 1
        spans.append((i, j))
        i = j
    return spans


def test_a_slow_environment_delays_only_its_own_episode(lm, tiny_tokenizer):
    log = []
    runner, _ = runner_for(lm, tiny_tokenizer,
                           lambda row: Scripted(turns=2, slow=1.0 if row["uid"] == "p0" else 0.0, log=log))
    runner.run(rows(), 1, SamplingParams(n=1, do_sample=False, max_new_tokens=60))
    slow_first = next(t for t, key, turn in log if key == "p0" and turn == 1)
    others = [t for t, key, turn in log if key == "p1"]
    assert len(others) >= 2 and max(others) < slow_first  # p1 went on through its turns meanwhile


def test_the_response_budget_truncates_an_episode(lm, tiny_tokenizer):
    runner, _ = runner_for(lm, tiny_tokenizer, lambda row: Scripted(turns=50))
    for ep in runner.run(rows(), 2, SamplingParams(n=2, do_sample=False, max_new_tokens=25)):
        assert ep.truncated and len(ep.tokens) <= 25


def test_turn_limits_end_episodes(lm, tiny_tokenizer):
    runner, _ = runner_for(lm, tiny_tokenizer, lambda row: Scripted(turns=50), max_assistant_turns=2)
    for ep in runner.run(rows(), 1, SamplingParams(n=1, do_sample=False, max_new_tokens=200)):
        assert ep.assistant_turns == 2 or ep.truncated
    runner, _ = runner_for(lm, tiny_tokenizer, lambda row: Scripted(turns=50, role="user"), max_user_turns=1)
    for ep in runner.run(rows(), 1, SamplingParams(n=1, do_sample=False, max_new_tokens=200)):
        assert ep.user_turns <= 1 and (ep.assistant_turns == 2 or ep.truncated)


class Rounds:
    """Answers every turn with two messages of `role` (one environment round), for ever."""

    def __init__(self, role):
        self.role = role

    def reset(self, row):
        return Reset(messages=row["prompt"])

    def step(self, episode):
        return Step(messages=[{"role": self.role, "content": "a"}, {"role": self.role, "content": "b"}])

    def close(self):
        pass


@pytest.mark.parametrize("role", ["tool", "user"])
def test_max_user_turns_counts_each_environment_round_as_verl_does(lm, tiny_tokenizer, role):
    """verl's user turns: each environment answer that appends messages is one, whatever their roles and however
    many (two tool results of one round are one turn); at `max_user_turns` = 2 the episode ends after the policy's
    turn that follows the 2nd round — 3 assistant turns, 2 appended rounds."""
    runner, _ = runner_for(lm, tiny_tokenizer, lambda row: Rounds(role), max_user_turns=2)
    episodes = runner.run(rows(), 1, SamplingParams(n=1, do_sample=False, max_new_tokens=300))
    for ep in episodes:
        if not ep.truncated:
            assert (ep.user_turns, ep.assistant_turns) == (2, 3)
            assert sum(1 for i, _ in _spans(ep.mask) if not ep.mask[i]) == 2
    assert any(not ep.truncated for ep in episodes)


HANGING = """
import sys, threading
import torch
from posttrain.agents.environment import Reset
from posttrain.agents.loop import EpisodeRunner
from posttrain.agents.settings import AgentSettings
from posttrain.models.load import load_causal_lm, load_tokenizer
from posttrain.rollout.base import SamplingParams
from posttrain.rollout.engine import DecodeEngine

class Hangs:
    def reset(self, row):
        return Reset(messages=[{"role": "user", "content": "Add 2 and 3."}])
    def step(self, episode):
        threading.Event().wait()  # never answers
    def close(self):
        pass

class Quick(AgentSettings):
    @property
    def step_timeout_s(self):
        return 0.2

tok = load_tokenizer(sys.argv[1])
model = load_causal_lm(sys.argv[1])
torch.manual_seed(0)
with torch.no_grad():
    for p in model.parameters():
        if p.dim() == 2:
            p.normal_(0, 0.3)
engine = DecodeEngine(model, tok, device=torch.device("cpu"), dtype=torch.float32)
engine.eos_ids = {t for t in range(len(tok)) if t % 5 == 0} | {tok.convert_tokens_to_ids("<|im_end|>")}
runner = EpisodeRunner(engine, tok, Quick(tokenization_sanity_check_mode="disable"), environments=lambda row: Hangs())
for continuous in (True, False):
    ep, = runner.run([{"uid": "p0"}], 1, SamplingParams(n=1, do_sample=False, max_new_tokens=60), continuous=continuous)
    print(ep.tool_errors, flush=True)
"""


def test_a_process_whose_environment_step_hangs_past_its_time_limit_still_exits(tmp_path, tiny_model_dir):
    """An environment step that never returns ends its episode at `step_timeout_s` (counted) in both loops, and the
    abandoned step's thread does not keep the process from exiting (a thread pool's would be joined at exit)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    (tmp_path / "hangs.py").write_text(HANGING)
    path = os.pathsep.join(p for p in (str(Path(__file__).parents[1]), os.environ.get("PYTHONPATH", "")) if p)
    try:
        done = subprocess.run([sys.executable, str(tmp_path / "hangs.py"), str(tiny_model_dir)], capture_output=True,
                              text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path})
    except subprocess.TimeoutExpired as e:
        raise AssertionError(f"the process did not exit: {e.stdout!r}") from None
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines() == ["{'environment_timeout': 1}"] * 2


def test_an_environment_that_raises_or_hangs_ends_only_its_episode_counted(lm, tiny_tokenizer):
    class Quick(AgentSettings):
        @property
        def step_timeout_s(self):
            return 0.5

    engine = DecodeEngine(lm, tiny_tokenizer, device=torch.device("cpu"), dtype=torch.float32)
    im_end = tiny_tokenizer.convert_tokens_to_ids("<|im_end|>")
    bad = {"p0": dict(fail=1), "p1": dict(hang=1)}
    runner = EpisodeRunner(engine, tiny_tokenizer, Quick(tokenization_sanity_check_mode="disable"),
                           environments=lambda row: Scripted(**bad[row["uid"]]))
    runner.template = Template(tiny_tokenizer, {im_end})
    engine.eos_ids = {t for t in range(len(tiny_tokenizer)) if t % 5 == 0} | {im_end}
    raised, hung = runner.run(rows(), 1, SamplingParams(n=1, do_sample=False, max_new_tokens=60))
    assert raised.tool_errors == {"environment_raised": 1} or raised.truncated
    assert hung.tool_errors == {"environment_timeout": 1} or hung.truncated


def test_the_tokenization_check_compares_the_kept_ids_with_a_full_re_render(lm, tiny_tokenizer):
    """Kept ids that are the template's own rendering pass; a policy turn the tokenizer would have split
    differently (here " ####" sampled as five one-character tokens where the tokenizer writes one) is a
    mismatch; `ignore_strippable` forgives whitespace only."""
    tok = tiny_tokenizer
    runner, engine = runner_for(lm, tok, lambda row: Scripted(), tokenization_sanity_check_mode="strict")
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    prompt = [{"role": "user", "content": "Add 2 and 3."}]

    def episode(turn_ids):
        from posttrain.agents.episode import Episode
        ep = Episode(prompt_ids=render(tok, prompt, None, add_generation_prompt=True), messages=list(prompt))
        runner._end_turn(ep, turn_ids + [im_end], None)
        ep.messages[-1]["content"] = tok.decode(turn_ids)
        runner._finish(ep)
        return ep

    canonical = tok("The sum is #### 5.", add_special_tokens=False)["input_ids"]
    assert not episode(canonical).tokenization_mismatch
    pieces = [i for ch in "The sum is #### 5." for i in tok(ch, add_special_tokens=False)["input_ids"]]
    assert pieces != canonical
    assert episode(pieces).tokenization_mismatch
    runner.settings = AgentSettings(tokenization_sanity_check_mode="ignore_strippable")
    assert not episode(pieces).tokenization_mismatch  # the same text
    spaced = tok(" The sum is #### 5.", add_special_tokens=False)["input_ids"]
    ep = episode(spaced)
    ep.messages[-1]["content"] = "The sum is #### 5."  # what a template that strips contents would render
    runner._finish(ep)
    assert not ep.tokenization_mismatch


def test_the_batch_of_episodes_has_holes_in_its_policy_mask_only(lm, tiny_tokenizer):
    runner, engine = runner_for(lm, tiny_tokenizer, lambda row: Scripted())
    s = SamplingParams(n=2, do_sample=False, max_new_tokens=40, logprobs=True)
    episodes = runner.run(rows(), 2, s)
    meta = Batch({}, {"uid": ["p0", "p1"]}).repeat_interleave(2)
    out = episodes_batch(meta, episodes, engine.pad_id, logprobs=True)
    for i, ep in enumerate(episodes):
        n = len(ep.tokens)
        assert out["responses"][i, :n].tolist() == ep.tokens
        assert out["response_mask"][i, :n].tolist() == ep.mask and out["response_mask"][i, n:].sum() == 0
        assert out["response_attention_mask"][i].tolist() == [1] * n + [0] * (out["responses"].shape[1] - n)
        P = out["prompts"].shape[1]
        assert out["input_ids"][i, P - len(ep.prompt_ids):P].tolist() == ep.prompt_ids
        assert out["attention_mask"][i].sum() == len(ep.prompt_ids) + n
    assert out.meta["env_reward"] == [e.env_reward for e in episodes]
