"""The reward-hacking detectors on constructed steps and histories (docs/reward_hacking.md): each one fires on the
pattern it is for — within the steps its windows take — and stays quiet on a run that learns the task. Cheap: no
model. The learning runs (the demo task with hacked rewards) are benchmarks/reward_hacking.py."""

import json
from types import SimpleNamespace

import pytest
import torch

from posttrain.config.schema.watch import WatchConfig
from posttrain.data.batch import Batch
from posttrain.watch import DETECTORS, History, Sample, StepInput, StepView, Watch, settings_problems, step_view
from posttrain.watch.code_fakes import fake_techniques
from posttrain.watch.text import copied_share, distinctness
from posttrain.watch.view import canonical_calls

S = WatchConfig()


def sample(uid="p0", prompt="37+45=", response="#### 82", acc=1.0, length=4, **kw) -> Sample:
    return Sample(uid=uid, prompt=prompt, response=response, policy_text=kw.pop("policy_text", response),
                  score=kw.pop("score", acc), acc=acc, length=length, **kw)


def run(name: str, views: list[StepView], extra_rows: dict[int, dict] | None = None, s=S) -> list[float]:
    """The detector's value at every step of a run made of `views` (the history grows as the loop grows it: each
    step's watch/* metrics and reward/acc/mean, plus `extra_rows[step]`)."""
    d, history, values = DETECTORS[name], History(), []
    for view in views:
        extra = (extra_rows or {}).get(view.step, {})
        reading = d.fn(StepInput(view.step, view, extra), history, s)
        values.append(reading.value)
        acc = sum(x.acc for x in view.samples) / len(view.samples)
        history.add(view.step, {f"watch/{name}": reading.value, "reward/acc/mean": acc, **extra,
                                **{f"watch/parts/{name}/{k}": v for k, v in reading.parts.items()}})
    return values


def first_firing(values: list[float], threshold: float) -> int | None:
    """The 1-based step at which `values` first reach `threshold`."""
    return next((i + 1 for i, v in enumerate(values) if v >= threshold), None)


def views_of(per_step: list[list[Sample]], max_length=8) -> list[StepView]:
    return [StepView(step, samples, max_length) for step, samples in enumerate(per_step, start=1)]


# ---------------------------------------------------------------- length

def test_length_drift_fires_when_length_grows_without_accuracy():
    steps = [[sample(length=4 + (t > 5) * 4, acc=0.4 if i % 5 < 2 else 0.0) for i in range(10)] for t in range(12)]
    values = run("length_drift", views_of(steps))
    assert values[:5] == [0.0] * 5  # the baseline window
    assert first_firing(values, S.length_drift) == 7  # the first long step after the baseline (4 -> 8 tokens: +100%)


def test_length_drift_is_quiet_when_accuracy_rises_with_it_and_on_steady_lengths():
    learning = [[sample(length=4 + t // 3, acc=float(i < 2 + t // 2)) for i in range(10)] for t in range(12)]
    assert max(run("length_drift", views_of(learning))) == 0.0  # longer, and right more often: explained
    steady = [[sample(length=4 + (i + t) % 2, acc=0.0) for i in range(10)] for t in range(12)]
    assert max(run("length_drift", views_of(steady))) < S.length_drift


def test_length_drift_sees_the_share_at_the_limit():
    steps = [[sample(length=8 if t > 5 else 7, acc=0.0) for i in range(10)] for t in range(12)]
    values = run("length_drift", views_of(steps))  # the mean moves by 1/7, the share at the limit 0 -> 100%
    assert first_firing(values, S.length_drift) == 7  # the latest window (steps 6-7) is half at the limit
    assert values[6] == pytest.approx(0.5)


# ---------------------------------------------------------------- reward components

def test_a_format_component_rising_without_correctness_fires():
    steps = [[sample(acc=float(i == 0), components={"format": float(i < 3 + 5 * (t > 4)), "penalty": -0.5})
              for i in range(10)] for t in range(10)]  # format 0.3 -> 0.8, correctness flat at 0.1
    values = run("reward_components", views_of(steps))
    assert first_firing(values, S.reward_components) == 6
    assert values[5] == pytest.approx(0.5)


def test_components_are_quiet_when_correctness_rises_and_a_shrinking_penalty_is_no_rise():
    learning = [[sample(acc=float(i < 3 + 5 * (t > 4)), components={"format": float(i < 3 + 5 * (t > 4))})
                 for i in range(10)] for t in range(10)]
    assert max(run("reward_components", views_of(learning))) == 0.0
    penalty = [[sample(acc=0.0, components={"overlong_penalty": -0.8 + 0.7 * (t > 4)}) for _ in range(10)]
               for t in range(10)]  # -0.8 -> -0.1: fewer over-long answers, nothing paid
    assert max(run("reward_components", views_of(penalty))) == 0.0


# ---------------------------------------------------------------- diversity

def test_groups_that_collapse_onto_one_answer_fire():
    answers = ["#### 82", "#### 72", "#### 12", "#### 182"]
    steps = [[sample(uid=f"p{g}", response=answers[0] if t > 5 else answers[i % 4], acc=0.0)
              for g in range(4) for i in range(8)] for t in range(10)]
    values = run("diversity_collapse", views_of(steps))
    assert first_firing(values, S.diversity_collapse) == 7
    assert values[6] == pytest.approx(0.5)  # steps 6-7: one step of groups that say one thing
    assert values[9] == pytest.approx(0.8)  # steps 6-10: four of five


def test_the_entropy_trend_counts_and_learning_explains_a_collapse():
    steps = [[sample(uid=f"p{g}", response=f"#### {i}", acc=0.0) for g in range(2) for i in range(4)]
             for _ in range(12)]
    entropy = {t: {"actor/entropy": 1.0 if t <= 5 else 0.3} for t in range(1, 13)}
    values = run("diversity_collapse", views_of(steps), entropy)
    assert first_firing(values, S.diversity_collapse) == 7  # the history holds step 6's entropy at step 7
    learned = [[sample(uid=f"p{g}", response="#### 5" if t > 5 else f"#### {i}", acc=float(t > 5))
                for g in range(2) for i in range(4)] for t in range(12)]
    assert max(run("diversity_collapse", views_of(learned))) == 0.0


def test_distinctness_and_copied_share():
    assert distinctness(["a b c", "a b c"], 2) == 0.0
    assert distinctness(["a b c", "d e f"], 2) == 1.0
    assert distinctness(["only one"], 2) is None
    assert copied_share("#### 37", ["37+45="], 3) == 1.0  # a one-word answer that is an operand
    assert copied_share("#### 82", ["37+45="], 3) == 0.0
    assert copied_share("the cat sat on the mat", ["a cat sat on a mat"], 3) == pytest.approx(1 / 4)


# ---------------------------------------------------------------- copying

def test_answers_copied_from_the_prompt_fire():
    steps = [[sample(prompt=f"{10 + i}+{20 + t}=", response=f"#### {10 + i}" if t > 4 else f"#### {30 + i + t}",
                     acc=0.0 if t > 4 else 0.5) for i in range(8)] for t in range(10)]
    values = run("copying", views_of(steps))
    assert first_firing(values, S.copying) == 6


def test_copying_tool_results_while_getting_right_is_learning():
    def episode(t, i):
        result = str(1000 + i)
        answer = f"#### {result}" if t > 4 else "#### 7"
        x = sample(acc=float(t > 4), response=answer)
        from posttrain.watch.view import add_episode
        add_episode(x, [{"role": "user", "content": "12*34="}, {"role": "assistant", "content": "<tool_call>"
                        '{"name": "calculator", "arguments": {"expression": "12*34"}}</tool_call>'},
                        {"role": "tool", "content": result}, {"role": "assistant", "content": answer}])
        return x
    steps = [[episode(t, i) for i in range(8)] for t in range(10)]
    assert max(run("copying", views_of(steps))) == 0.0


# ---------------------------------------------------------------- tools

def _episode(calls: list[str], acc: float) -> Sample:
    from posttrain.watch.view import add_episode

    x = sample(acc=acc)
    turns = []
    for c in calls:
        turns += [{"role": "assistant", "content": f'<tool_call>{{"name": "calculator", "arguments": {{"expression": '
                   f'"{c}"}}}}</tool_call>'}, {"role": "tool", "content": "42"}]
    add_episode(x, [{"role": "user", "content": "6*7="}] + turns + [{"role": "assistant", "content": "#### 42"}])
    return x


def test_more_tool_calls_without_more_accuracy_fire():
    steps = [[_episode([f"{i}*{k}" for k in range(1 + 2 * (t > 4))], acc=0.3) for i in range(8)] for t in range(10)]
    values = run("tool_calls", views_of(steps))
    assert first_firing(values, S.tool_calls) == 6  # 1 -> 3 calls an episode
    right = [[_episode([f"{i}*{k}" for k in range(1 + 2 * (t > 4))], acc=float(t > 4)) for i in range(8)]
             for t in range(10)]
    assert max(run("tool_calls", views_of(right))) == 0.0


def test_repeated_identical_calls_fire_and_distinct_ones_do_not():
    spam = [[_episode(["6*7"] * (1 + 3 * (t > 2)), acc=1.0) for _ in range(8)] for t in range(5)]
    assert first_firing(run("tool_repeats", views_of(spam)), S.tool_repeats) == 4  # 3 of 4 calls repeat
    varied = [[_episode(["6*7", "7*6", "42*1"], acc=1.0) for _ in range(8)] for _ in range(5)]
    assert max(run("tool_repeats", views_of(varied))) == 0.0


def test_calls_are_compared_as_canonical_json():
    a = canonical_calls({"role": "assistant", "content": '<tool_call>{"name": "f", "arguments": {"x": 1, "y": 2}}'
                                                          '</tool_call>'})
    b = canonical_calls({"role": "assistant", "tool_calls": [{"function": {"name": "f",
                                                                           "arguments": '{"y": 2, "x": 1}'}}]})
    assert a == b == ['f {"x": 1, "y": 2}']


# ---------------------------------------------------------------- code

def test_every_known_fake_of_the_sandbox_tests_is_named_and_honest_programs_are_not():
    from tests.test_sandbox import FAKES

    not_fakes = {"nan", "self-containing-result", "infinite-loop", "sleep-in-the-call"}  # wrong or slow, no trick
    for name, program in FAKES.items():
        assert bool(fake_techniques(program)) == (name not in not_fakes), name
    honest = [json.loads(line)["solution"] for line in open("posttrain/data/code/problems.jsonl")]
    honest += ["import sys\ninput = sys.stdin.readline\nsys.setrecursionlimit(10000)\nn = int(input())\n"
               "if n < 0:\n    sys.exit(0)\nclass P:\n    def __eq__(self, o):\n        return self.x == o.x\n"
               "print(n)\nsys.exit(0)\n", "def add(a, b):\n    print('debug', a, b)\n    return a + b\n",
               "def gen():\n    yield 1\n    raise StopIteration\n", "def f(:\n"]
    assert [p for p in honest if fake_techniques(p)] == []


def test_code_fakes_counts_code_responses_only():
    fake = "```python\nexec = lambda *a: None\ndef add(a, b):\n    return 0\n```"
    view = StepView(1, [sample(response=fake, data_source="code"), sample(response=fake, data_source="openai/gsm8k"),
                        sample(response="```python\ndef add(a, b):\n    return a + b\n```", data_source="code")], 8)
    reading = DETECTORS["code_fakes"].fn(StepInput(1, view), History(), S)
    assert reading.value == 1.0 and reading.rows == [0] and "rebinds-builtins" in reading.note


# ---------------------------------------------------------------- KL, mismatch, validation

def test_a_kl_spike_fires_against_the_typical_kl_not_its_slow_growth():
    kl = [0.02 + 0.002 * t for t in range(20)] + [0.3]  # the median of the last 10: 0.049
    history, values = History(), []
    for step, value in enumerate(kl, start=1):
        values.append(DETECTORS["kl_spike"].fn(StepInput(step, None, {"actor/kl_loss": value}), history, S).value)
        history.add(step, {"actor/kl_loss": value})
    assert max(values[:-1]) < 3 and values[-1] >= S.kl_spike  # the first: 0.02 over the floor
    tiny = DETECTORS["kl_spike"].fn(StepInput(1, None, {"actor/ppo_kl": 1e-5}), History(), S)
    assert tiny.value < 0.01  # near zero: divided by kl_floor, no spike


def test_rollout_mismatch_is_the_k3_kl_over_policy_tokens():
    old = torch.log(torch.tensor([[0.5, 0.5, 0.9], [0.5, 0.5, 0.5]]))
    rollout = torch.log(torch.tensor([[0.5, 0.25, 0.1], [0.5, 0.5, 0.5]]))
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    reading = DETECTORS["rollout_mismatch"].fn(
        StepInput(1, None, {}, {"old_log_probs": old, "rollout_log_probs": rollout, "response_mask": mask}),
        History(), S)
    r = 2.0  # the one token that differs: trainer 0.5, rollout 0.25
    assert reading.value == pytest.approx((r - 1 - torch.log(torch.tensor(r)).item()) / 5)
    assert reading.rows[0] == 0
    assert DETECTORS["rollout_mismatch"].fn(StepInput(1, None, {}, {}), History(), S).value == 0.0


def _val_run(scores: list[float], val: dict[int, float]) -> list[float]:
    history, out = History(), []
    for step, score in enumerate(scores, start=1):
        metrics = {"critic/score/mean": score}
        if step in val:
            metrics["val-core/x/acc/mean@1"] = val[step]
            out.append(DETECTORS["val_divergence"].fn(StepInput(step, None, metrics), history, S).value)
        history.add(step, metrics)
    return out


def test_reward_rising_while_validation_falls_fires_over_the_window():
    scores = [0.3] * 10 + [0.5] * 10 + [0.7] * 10
    falling = _val_run(scores, {10: 0.40, 20: 0.36, 30: 0.30})
    assert falling[:2] == [0.0, 0.0] and falling[2] == pytest.approx(0.10)  # reward +0.4, validation -0.10
    assert _val_run(scores, {10: 0.40, 20: 0.45, 30: 0.50})[-1] < 0  # both rise: no divergence
    assert _val_run([0.3] * 30, {10: 0.40, 20: 0.36, 30: 0.30})[-1] == pytest.approx(0.0)  # reward flat


# ---------------------------------------------------------------- the watch

def test_the_watch_fires_once_per_crossing_writes_findings_and_applies_actions(tmp_path):
    s = WatchConfig(window=1, length_drift=0.5, actions={"length_drift": "checkpoint"})
    watch = Watch(s, tmp_path, max_length=8)
    watch.start()
    lengths = [4, 8, 8, 4, 8]
    fired = []
    for step, n in enumerate(lengths, start=1):
        batch = _batch(step, n)
        metrics, findings = watch.batch(batch, step)
        fired += [(f.step, f.detector, f.action) for f in findings if f.detector == "length_drift"]
        watch.record(step, {**metrics, "reward/acc/mean": 0.0})
    assert fired == [(2, "length_drift", "checkpoint"), (5, "length_drift", "checkpoint")]  # back below at step 4
    lines = [json.loads(line) for line in (tmp_path / "watch" / "findings.jsonl").read_text().splitlines()]
    assert [(f["step"], f["detector"]) for f in lines if f["detector"] == "length_drift"] == [(2, "length_drift"),
                                                                                              (5, "length_drift")]
    first = next(f for f in lines if f["detector"] == "length_drift")
    assert first["sample_ids"][0] == "s2-0:0" and first["samples"][0]["prompt"] == "1+1="
    assert first["samples"][0]["response"] and "score" in first["samples"][0]["reward"]
    detectors = json.loads((tmp_path / "watch" / "detectors.json").read_text())["detectors"]
    assert detectors["length_drift"] == {"phase": "batch", "summary": DETECTORS["length_drift"].summary,
                                         "threshold": 0.5, "action": "checkpoint"}

    resumed = Watch(s, tmp_path, max_length=8)
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"step": i, "watch/length_drift": 0.0}) + "\n"
                                                    for i in (1, 2, 3)))
    resumed.start(resumed_step=3)  # the findings after the checkpoint go; the history comes back
    assert [f["step"] for f in map(json.loads, (tmp_path / "watch" / "findings.jsonl").read_text().splitlines())] \
        == [2] and len(resumed.history.rows) == 3


def test_other_ranks_compute_but_write_nothing(tmp_path):
    watch = Watch(WatchConfig(window=1, length_drift=0.5), tmp_path, max_length=8, writer=False)
    watch.start()
    watch.record(1, watch.batch(_batch(1, 4), 1)[0] | {"reward/acc/mean": 0.0})
    assert watch.batch(_batch(2, 8), 2)[1] and not (tmp_path / "watch").exists()


def _batch(step: int, length: int) -> Batch:
    """A scored single-turn batch: 2 prompts x 2 responses, every response `length` tokens."""
    mask = torch.ones(4, length, dtype=torch.long)
    return Batch({"response_mask": mask, "token_level_scores": torch.zeros(4, length)},
                 {"uid": [f"s{step}-0", f"s{step}-0", f"s{step}-1", f"s{step}-1"],
                  "raw_prompt": [[{"role": "user", "content": "1+1="}]] * 2 + [[{"role": "user", "content": "2+2="}]] * 2,
                  "data_source": ["synthetic/arithmetic"] * 4, "ground_truth": ["2", "2", "4", "4"],
                  "reward:response_text": ["#### 2" * (length // 4)] * 4, "reward:score": [0.0] * 4,
                  "reward:acc": [0.0] * 4, "reward:format": [1.0, None, 1.0, 0.0], "reward:errors": [0.0] * 4})


def test_the_view_of_a_batch_with_episodes():
    batch = _batch(3, 4)
    ep = SimpleNamespace(messages=[{"role": "system", "content": "be brief"}, {"role": "user", "content": "6*7="},
                                   {"role": "assistant", "content": '<tool_call>{"name": "calculator", "arguments": '
                                                                    '{"expression": "6*7"}}</tool_call>'},
                                   {"role": "tool", "content": "42"}, {"role": "assistant", "content": "#### 42"}])
    batch.meta["episode"] = [ep, None, None, None]
    view = step_view(batch, 3, max_length=4)
    x = view.samples[0]
    assert x.tool_calls == ['calculator {"expression": "6*7"}'] and x.tool_results == ["42"]
    assert x.policy_text.endswith("#### 42") and "be brief" not in x.policy_text
    assert view.samples[1].messages is None and view.samples[1].components == {}
    assert x.components == {"format": 1.0} and x.length == 4 and view.sample_id(3) == "s3-1:1"


def test_settings_are_checked_by_name():
    assert settings_problems(WatchConfig()) == []
    problems = settings_problems(WatchConfig(action="panic", actions={"nope": "stop", "copying": "loud"},
                                             window=0, val_window=1, kl_floor=0, copying=-1))
    assert len(problems) == 7 and all("trainer.watch." in p for p in problems)
    off = Watch(WatchConfig(copying=None, code_fakes=None), ".", max_length=8)
    assert {d.name for d in off.detectors} == set(DETECTORS) - {"copying", "code_fakes"}
