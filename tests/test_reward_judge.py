"""The generative judge: its prompt is the template filled with the question, the response and the reference; its
verdict is parsed into a score (an unparseable one scores 0 and is counted); the score meets the rule scores by the
documented rule; the tiny judge's verdicts agree with correctness; and a run trains with it, in one process and
with the judge sharded over two."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from posttrain.config import ConfigError, load_config
from posttrain.data.batch import Batch
from posttrain.data.dataset import PromptItem, collate_prompts
from posttrain.data.synthetic import DATA_SOURCE, prompt_text
from posttrain.reward.judge import (DEFAULT_TEMPLATE, JudgeRewardManager, fill, parse_verdict, question_of,
                                    regex_parser, template_problem)
from posttrain.reward.manager import RewardManager

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def judge_dir(tmp_path_factory):
    """The tiny judge of the one-digit addition task (a few seconds of fine-tuning)."""
    from posttrain.tiny.judge import build_tiny_judge

    return build_tiny_judge(tmp_path_factory.mktemp("judge") / "judge")


def batch_of(tok, problems, responses, data_source=DATA_SOURCE):
    """Rows as the rollout leaves them: one chat per problem `(a, b)`, its response text (+ EOS)."""
    chats = [[{"role": "user", "content": prompt_text(a, b)}] for a, b in problems]
    items = [PromptItem(tok.apply_chat_template(c, add_generation_prompt=True, tokenize=True)["input_ids"],
                        data_source, str(a + b), raw_prompt=c) for c, (a, b) in zip(chats, problems)]
    prompts, prompt_mask = collate_prompts(items, tok.pad_token_id)
    ids = [tok(t, add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for t in responses]
    width = max(map(len, ids))
    out = torch.full((len(ids), width), tok.pad_token_id)
    mask = torch.zeros((len(ids), width), dtype=torch.long)
    for i, row in enumerate(ids):
        out[i, :len(row)], mask[i, :len(row)] = torch.tensor(row), 1
    return Batch({"prompts": prompts, "prompt_mask": prompt_mask, "responses": out, "response_mask": mask},
                 {"uid": [str(i) for i in range(len(ids))], "raw_prompt": chats,
                  "data_source": [data_source] * len(ids), "ground_truth": [str(a + b) for a, b in problems],
                  "extra_info": [{}] * len(ids)})


# ---------------------------------------------------------------- template

def test_template_is_filled_with_question_response_and_reference():
    chat = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+3="},
            {"role": "assistant", "content": "?"}, {"role": "user", "content": "7+8="}]
    assert question_of(chat) == "7+8="  # the last user turn
    text = fill("Q={question} | A={response} | ref={ground_truth} {{literal}}", question=question_of(chat),
                response="#### 15", ground_truth=15)
    assert text == "Q=7+8= | A=#### 15 | ref=15 {literal}"
    assert fill("{response}/{ground_truth}", question="", response="x", ground_truth=None) == "x/"
    default = fill(DEFAULT_TEMPLATE, question="1+1=", response="#### 2", ground_truth="2")
    assert "1+1=" in default and "#### 2" in default and "Reference answer: 2" in default


@pytest.mark.parametrize("template, fragment", [("{question} {answer}", "['answer'] are not known"),
                                                ("{question} {ground_truth}", "no {response} placeholder"),
                                                ("{response} }", "not a format string"),
                                                ("{0} {response}", "['0'] are not known")])
def test_bad_templates_are_named(template, fragment):
    assert fragment in template_problem(template)


# ---------------------------------------------------------------- parsing

@pytest.mark.parametrize("text, score", [("correct", 1.0), ("Incorrect.", 0.0), ("CORRECT", 1.0),
                                         ("It looks correct at first, but it is incorrect", 0.0),
                                         ("Not incorrect: correct", 1.0), ("the answer is 12", None),
                                         ("incorrectly", None), ("", None)])
def test_default_parser_reads_the_last_verdict_word(text, score):
    assert parse_verdict(text) == score


def test_regex_parser_reads_the_last_match():
    score = regex_parser(r"[Ss]core: *(-?[0-9.]+)")
    assert score("Score: 3 ... on reflection, score: 7.5") == 7.5 and score("no score") is None
    assert regex_parser(r"\[\[([0-9.]+)\]\]")("Rating: [[8]]") == 8.0
    assert regex_parser(r"-?\d+")("1 then 42") == 42.0  # no group: the whole match


def rule_and_judge(tok, rule_scores, verdicts, *, combine="replace", parse=parse_verdict, overlong=None):
    """A manager whose rule scorer gives `rule_scores` (by row, from extra_info) and whose judge answers
    `verdicts`; the judge's prompts are recorded."""
    seen = []

    def judge_fn(prompts):
        seen.extend(prompts)
        return list(verdicts)

    rule = RewardManager(tok, compute_score=lambda ds, text, truth, extra: extra["rule"], overlong=overlong,
                         log_overlong=overlong is not None)
    manager = JudgeRewardManager(rule, judge_fn, template="{question}|{response}|{ground_truth}", parse=parse,
                                 combine_mode=combine)
    manager.check_data_sources(["custom"])
    batch = batch_of(tok, [(1, 2), (3, 4), (5, 9), (6, 6)], ["#### 3", "#### 8", "#### 4", ""])
    batch.meta["extra_info"] = [{"rule": r} for r in rule_scores]
    return manager, batch, seen


def test_unparseable_verdicts_score_zero_and_are_counted(tiny_tokenizer):
    manager, batch, seen = rule_and_judge(tiny_tokenizer, [1.0, 0.0, 0.0, 0.0],
                                          ["correct", "I cannot tell", "incorrect", "maybe"])
    with pytest.warns(RuntimeWarning, match="could not be parsed") as caught:
        token_scores, extras = manager(batch)
    assert len([w for w in caught if "could not be parsed" in str(w.message)]) == 1  # logged once
    assert seen == ["1+2=|#### 3|3", "3+4=|#### 8|7", "5+9=|#### 4|14", "6+6=||12"]
    assert extras["judge_score"] == [1.0, 0.0, 0.0, 0.0]
    assert extras["judge_unparsed"] == [0.0, 1.0, 0.0, 1.0]
    assert extras["errors"] == [0.0, 1.0, 0.0, 1.0]
    assert extras["rule_score"] == [1.0, 0.0, 0.0, 0.0]
    # a parser that raises or returns NaN is unparseable too, never a crash
    bad = {"a": float("nan"), "b": None}
    manager, batch, _ = rule_and_judge(tiny_tokenizer, [0.0] * 4, ["a", "b", "c", "2.5"],
                                       parse=lambda text: bad[text] if text in bad else float(text))
    _, extras = manager(batch)
    assert extras["judge_score"] == [0.0, 0.0, 0.0, 2.5] and extras["errors"] == [1.0, 1.0, 1.0, 0.0]


# rule scores r and judge verdicts j, and the training reward each rule gives (worked out by hand)
R, J = [1.0, -0.5, 0.5, 2.0], ["score: 0.5", "score: 2", "score: -1", "score: 3"]
COMBINED = {"replace": [0.5, 2.0, -1.0, 3.0],
            "add": [1.5, 1.5, -0.5, 5.0],
            "multiply": [0.5, -1.0, -0.5, 6.0],
            "gate": [0.5, -0.5, -1.0, 3.0]}


@pytest.mark.parametrize("mode", list(COMBINED))
def test_combine_rules(tiny_tokenizer, mode):
    manager, batch, _ = rule_and_judge(tiny_tokenizer, R, J, combine=mode, parse=regex_parser(r"score: (-?\d+\.?\d*)"))
    token_scores, extras = manager(batch)
    lengths = batch["response_mask"].sum(-1)
    for i, want in enumerate(COMBINED[mode]):  # on the last response token, nowhere else
        row = torch.zeros(batch["responses"].shape[1])
        if lengths[i] > 0:
            row[lengths[i] - 1] = want
        torch.testing.assert_close(token_scores[i], row)
    assert extras["judge_score"] == [0.5, 2.0, -1.0, 3.0] and extras["rule_score"] == R


def test_overlong_shaping_is_added_to_the_combined_reward(tiny_tokenizer):
    manager, batch, _ = rule_and_judge(tiny_tokenizer, R, J, combine="add", parse=regex_parser(r"score: (-?\d+\.?\d*)"),
                                       overlong=(4, 2, 1.0))
    token_scores, extras = manager(batch)
    lengths = batch["response_mask"].sum(-1).tolist()
    penalty = [max(-(n - 2) / 2, -1.0) if n > 2 else 0.0 for n in lengths]
    assert extras["overlong_penalty"] == pytest.approx(penalty)
    want = [r + j + p for r, j, p in zip(R, [0.5, 2.0, -1.0, 3.0], penalty)]
    torch.testing.assert_close(token_scores.sum(-1), torch.tensor(want))


def test_combining_needs_rule_scores_for_every_row(tiny_tokenizer):
    manager = JudgeRewardManager(RewardManager(tiny_tokenizer), lambda p: [], combine_mode="add")
    with pytest.raises(ConfigError, match="combine=add needs a rule score for every row"):
        manager.check_data_sources(["no/such/source"])
    replace = JudgeRewardManager(RewardManager(tiny_tokenizer), lambda p: [])
    replace.check_data_sources(["no/such/source"])  # the judge alone scores
    assert not replace.rule_scoring


# ---------------------------------------------------------------- config

def judge_config(judge_dir, *extra):
    return load_config(None, ["reward_model.enable=True", f"reward_model.model.path={judge_dir}",
                              "reward_model.judge.enable=True", "actor_rollout_ref.rollout.dtype=fp32", *extra])


def test_judge_keys_load(judge_dir, tmp_path):
    parse = tmp_path / "parse.py"
    parse.write_text("def grade(text):\n    return float(text.count('+'))\n")
    cfg = judge_config(judge_dir, f"reward_model.judge.prompt_template_path={judge_dir / 'judge_template.txt'}",
                       f"reward_model.judge.parse_function.path={parse}", "reward_model.judge.parse_function.name=grade",
                       "reward_model.judge.combine=gate", "reward_model.judge.temperature=0.7",
                       "reward_model.judge.top_p=0.9", "reward_model.judge.response_length=8",
                       "reward_model.micro_batch_size_per_gpu=4")
    from posttrain.reward.judge import load_template, make_parser

    j = cfg.reward_model.judge
    assert load_template(j) == (judge_dir / "judge_template.txt").read_text()
    assert make_parser(j)("1+2+3") == 2.0 and j.combine == "gate"


@pytest.mark.parametrize("extra, fragment", [
    (["reward_model.judge.combine=max"], "reward_model.judge.combine='max' is not one of"),
    (["reward_model.judge.prompt_template='{question} {answer}'"], "['answer'] are not known"),
    (["reward_model.judge.prompt_template_path=/nope.txt"], "'/nope.txt' does not exist"),
    (["reward_model.judge.score_regex='(['"], "is not a regular expression"),
    (["reward_model.judge.score_regex=x", "reward_model.judge.parse_function.path=/nope.py"], "not both"),
    (["reward_model.judge.parse_function.path=PARSE", "reward_model.judge.parse_function.name=nope"],
     "defines no function 'nope' (functions there: ['parse'])"),
    (["reward_model.use_dynamic_bsz=True"], "the judge generates"),
    (["reward_model.judge.response_length=0"], "response_length must be positive"),
    (["reward_model.enable=False"], "judge.enable=True needs reward_model.enable=True"),
])
def test_bad_judge_settings_are_refused(judge_dir, tmp_path, extra, fragment):
    (tmp_path / "parse.py").write_text("def parse(text):\n    return 1.0\n")
    with pytest.raises(ConfigError) as e:
        judge_config(judge_dir, *[x.replace("PARSE", str(tmp_path / "parse.py")) for x in extra])
    assert fragment in str(e.value)


def test_a_causal_lm_without_judge_enable_points_to_it(judge_dir, tiny_tokenizer):
    from posttrain.parallel import Parallel
    from posttrain.roles.reward_model import RewardModel

    cfg = load_config(None, ["reward_model.enable=True", f"reward_model.model.path={judge_dir}"])
    with pytest.raises(ConfigError, match="set reward_model.judge.enable=True"):
        RewardModel.from_config(cfg, Parallel(), tiny_tokenizer)


# ---------------------------------------------------------------- the tiny judge

def test_tiny_judge_agrees_with_correctness(judge_dir):
    """Its verdicts, through the Judge role and the default parser, on rows drawn apart from its training rows (the
    one-digit task has about 300 distinct judge prompts, so nearly all of them were trained on)."""
    from posttrain.parallel import Parallel
    from posttrain.reward.judge import judge_reward
    from posttrain.reward.registry import default_compute_score
    from posttrain.roles.judge_model import Judge
    from posttrain.tiny.judge import judge_rows

    cfg = judge_config(judge_dir, f"reward_model.judge.prompt_template_path={judge_dir / 'judge_template.txt'}",
                       "reward_model.micro_batch_size_per_gpu=32")
    judge = Judge.from_config(cfg, Parallel())
    rows = judge_rows(seed=12345, n=200, operands=range(0, 10))
    verdicts = judge.verdicts([r["prompt"][0]["content"] for r in rows])
    scores = [parse_verdict(v) for v in verdicts]
    assert sum(s is None for s in scores) <= 4, verdicts[:20]  # it answers in verdict words
    truth = [float(r["response"] == "correct") for r in rows]
    agree = sum(s == t for s, t in zip(scores, truth)) / len(rows)
    base = max(sum(truth), len(truth) - sum(truth)) / len(truth)  # one verdict for everything: about 0.5
    assert agree >= 0.9 and agree > base + 0.3, (agree, base)
    # the right answer and the carry-free one (what the task's policy chooses between) are told apart
    manager = judge_reward(cfg, RewardManager(judge.tokenizer), judge)
    problems = [(a, b) for a in range(2, 10) for b in range(8, 10)]
    right = batch_of(judge.tokenizer, problems, [f"#### {a + b}" for a, b in problems])
    wrong = batch_of(judge.tokenizer, problems, [f"#### {(a + b) % 10}" for a, b in problems])
    _, good = manager(right)
    _, bad = manager(wrong)
    assert good["acc"] == [1.0] * len(problems) and bad["acc"] == [0.0] * len(problems)  # the rule, for reference
    mean = lambda xs: sum(xs) / len(xs)
    assert mean(good["judge_score"]) - mean(bad["judge_score"]) >= 0.6, (good["judge_verdict"], bad["judge_verdict"])


def test_a_tiny_judge_that_does_not_agree_in_time_is_refused(tmp_path):
    """The tiny judge trains until it agrees with the rule, not for a fixed number of steps: one that has not by
    max_steps is an error naming the agreement reached, and leaves no model behind."""
    from posttrain.tiny.judge import JudgeNotTrained, build_tiny_judge

    with pytest.raises(JudgeNotTrained, match=r"after max_steps=40 steps \(wanted 99%\); agreement every 20 steps: "
                                              r"\[0\.\d+, 0\.\d+\]"):
        build_tiny_judge(tmp_path / "judge", max_steps=40, check_every=20)
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # no model, link, versions or build folder


# ---------------------------------------------------------------- training with the judge

def test_posttrain_train_with_the_judge(judge_dir, tiny_model_dir, tmp_path):
    """`posttrain train` with the judge as the reward: its score is the training reward, the rule's accuracy stays
    a metric, validation stays rule-based."""
    from posttrain.cli import main
    from posttrain.data.synthetic import rl_row

    rows = [rl_row(a, b, "train", i) for i, (a, b) in enumerate([(1, 2), (3, 4), (5, 6), (7, 8)])]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    main(["train", "algorithm.adv_estimator=grpo", f"actor_rollout_ref.model.path={tiny_model_dir}",
          f"data.train_files={tmp_path / 'train.jsonl'}", f"data.val_files={tmp_path / 'train.jsonl'}",
          "data.train_batch_size=2", "data.max_prompt_length=32", "data.max_response_length=6",
          "actor_rollout_ref.rollout.n=3", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
          "actor_rollout_ref.model.enable_gradient_checkpointing=False", "reward_model.num_workers=0",
          "reward_model.enable=True", f"reward_model.model.path={judge_dir}", "reward_model.judge.enable=True",
          f"reward_model.judge.prompt_template_path={judge_dir / 'judge_template.txt'}",
          "reward_model.judge.response_length=4", "reward_model.micro_batch_size_per_gpu=4",
          "trainer.total_training_steps=2", "trainer.logger=['jsonl']", "trainer.val_before_train=False",
          "trainer.test_freq=2", f"trainer.default_local_dir={tmp_path / 'run'}"])
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    train = [m for m in metrics if "critic/score/mean" in m]
    assert [m["step"] for m in train] == [1, 2]
    for m in train:
        for key in ("reward/judge_score/mean", "reward/judge_unparsed/mean", "reward/rule_score/mean",
                    "reward/acc/mean", "reward/errors", "actor/pg_loss"):
            assert key in m, key
        assert m["critic/score/mean"] == pytest.approx(m["reward/judge_score/mean"], abs=1e-6)
        assert m["reward/errors"] == pytest.approx(6 * m["reward/judge_unparsed/mean"])  # 2 prompts x 3 responses
    assert any(k.startswith("val-core/synthetic/arithmetic/") for m in metrics for k in m)


WORKER = '''
import json, sys
from posttrain.config import load_config
from posttrain.parallel import init_parallel, shutdown
from posttrain.parallel.context import exit_process
from posttrain.roles.judge_model import Judge

judge_dir, prompts_file, out = sys.argv[1:4]
par = init_parallel(device_name="cpu")
cfg = load_config(None, ["reward_model.enable=True", f"reward_model.model.path={judge_dir}",
                         "reward_model.judge.enable=True", "actor_rollout_ref.rollout.dtype=fp32",
                         "reward_model.micro_batch_size_per_gpu=2"])
judge = Judge.from_config(cfg, par)
from posttrain.parallel import is_sharded
assert is_sharded(judge.model)
prompts = json.load(open(prompts_file))
rows = [[0, 1, 2, 3, 4], []][par.rank]  # uneven shares: rank 1 has no prompt and still joins the gather
verdicts = judge.verdicts([prompts[i] for i in rows])
gathered = par.gather((rows, verdicts))
if par.is_main:
    with open(out, "w") as f:
        json.dump(sorted((r, v) for rs, vs in gathered for r, v in zip(rs, vs)), f)
shutdown()
exit_process(0)  # as `posttrain` ends: no interpreter teardown racing gloo's worker threads
'''


def test_two_processes_judge_as_one(judge_dir, tmp_path):
    """The judge FSDP2-sharded over two processes, each rank judging its own prompts, gives one process's
    verdicts."""
    from posttrain.parallel import Parallel
    from posttrain.roles.judge_model import Judge
    from posttrain.tiny.judge import judge_rows

    prompts = [r["prompt"][0]["content"] for r in judge_rows(seed=7, n=5, operands=range(0, 10))]
    cfg = judge_config(judge_dir, "reward_model.micro_batch_size_per_gpu=2")
    one = Judge.from_config(cfg, Parallel()).verdicts(prompts)
    (tmp_path / "prompts.json").write_text(json.dumps(prompts))
    (tmp_path / "worker.py").write_text(WORKER)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                             str(tmp_path / "worker.py"), str(judge_dir), str(tmp_path / "prompts.json"),
                             str(tmp_path / "out.json")], capture_output=True, text=True, env=env, timeout=600, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-4000:]
    two = json.loads((tmp_path / "out.json").read_text())
    assert [r for r, _ in two] == list(range(5)) and [v for _, v in two] == one


@pytest.mark.slow
def test_grpo_with_the_judge_as_the_only_reward_learns(small_task, judge_dir):
    """GRPO from the small task's SFT model with the judge's score as the only reward (the setting of
    tests/test_learning.py's grpo family): the rule's accuracy, which the judge never sees, rises."""
    from posttrain.trainer.rl import RLTrainer
    from tests.test_rl_integration import read_metrics, rl_config

    out, files = small_task
    run = "learn_judge"
    cfg = rl_config(out, files, run, 40, "reward_model.num_workers=0", "reward_model.enable=True",
                    f"reward_model.model.path={judge_dir}", "reward_model.judge.enable=True",
                    f"reward_model.judge.prompt_template_path={judge_dir / 'judge_template.txt'}",
                    "reward_model.judge.response_length=4", "reward_model.micro_batch_size_per_gpu=180")
    RLTrainer(cfg).fit()
    metrics = read_metrics(out / run)
    judge, acc = [m["reward/judge_score/mean"] for m in metrics], [m["reward/acc/mean"] for m in metrics]
    assert [m["critic/score/mean"] for m in metrics] == pytest.approx(judge)  # the judge alone is the reward
    first, last = sum(acc[:4]) / 4, sum(acc[-10:]) / 10
    assert last > first + 0.05, ([round(a, 3) for a in acc], [round(j, 3) for j in judge])
