"""Rule scorers against the real benchmarks (every reference solution must get full marks) and hand-made edge cases,
plus data_source dispatch, user scorers and custom reward files."""

import importlib.util
import json
import re
import sys
import threading
from pathlib import Path

import pytest
import torch

from posttrain.reward import gsm8k, registry
from posttrain.reward import math as math_reward
from posttrain.reward.registry import (
    UnknownDataSourceError,
    default_compute_score,
    extract_answer_for,
    load_custom_reward_function,
    register_scorer,
)

DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
needs_data = pytest.mark.skipif(not DATA.is_dir(), reason=f"shared benchmark data not found at {DATA}")


def rows(rel):
    with (DATA / rel).open() as f:
        return [json.loads(line) for line in f if line.strip()]


def gsm8k_truth(answer: str) -> str:
    # independent of the scorer: the text of the last line after '####', commas removed
    last = answer.strip().splitlines()[-1]
    assert last.startswith("#### "), last
    return last[len("#### "):].replace(",", "").strip()


# ------------------------------------------------------------------------------------------------ GSM8K on real data

@needs_data
@pytest.mark.parametrize("split", ["test", "train"])
def test_gsm8k_reference_solutions_score_full(split):
    data = rows(f"gsm8k/{split}.jsonl")
    assert len(data) == {"test": 1319, "train": 7473}[split]
    bad = [(i, r["answer"][-80:]) for i, r in enumerate(data)
           if gsm8k.compute_score(r["answer"], gsm8k_truth(r["answer"])) != 1.0]
    assert not bad, bad[:5]
    # flexible mode agrees on every reference solution too (its last number is the #### answer)
    bad = [i for i, r in enumerate(data)
           if gsm8k.compute_score(r["answer"], gsm8k_truth(r["answer"]), method="flexible") != 1.0]
    assert not bad, bad[:5]


@needs_data
def test_gsm8k_wrong_answers_score_zero():
    for r in rows("gsm8k/test.jsonl"):
        truth = gsm8k_truth(r["answer"])
        wrong = str(int(truth) + 1) if re.fullmatch(r"-?\d+", truth) else truth + "1"
        assert gsm8k.compute_score(r["answer"], wrong) == 0.0
        assert gsm8k.compute_score(r["answer"], wrong, format_score=0.1) == 0.1  # answer found, but wrong


# ------------------------------------------------------------------------------------------------ GSM8K edge cases

@pytest.mark.parametrize("text,truth,strict,flexible", [
    ("so the total is #### 18", "18", 1.0, 1.0),
    ("#### 1,234", "1234", 1.0, 1.0),             # thousands separators stripped from the response
    ("#### 1234", "1,234", 1.0, 1.0),             # ... and from the ground truth
    ("#### 1234", "$1,234", 1.0, 1.0),            # dollar signs stripped from the ground truth
    ("She pays $1,234 in total.", "1234", 0.0, 1.0),  # no '####': strict finds nothing, flexible takes 1234
    ("#### 5 then later #### 7", "7", 1.0, 1.0),  # last match wins
    ("#### 5 then later #### 7", "5", 0.0, 0.0),
    ("#### -3", "-3", 1.0, 1.0),
    ("#### 18.00", "18", 0.0, 1.0),               # strict is an exact string match; flexible compares numbers
    ("#### 18.", "18", 0.0, 1.0),                 # the common strict rule keeps the period; flexible drops it
    ("I don't know.", "18", 0.0, 0.0),            # no number at all
    ("", "18", 0.0, 0.0),
    ("The answer is 18. Done.", "18", 0.0, 1.0),  # flexible skips the lone '.' and takes 18
    ("####18", "18", 0.0, 1.0),                   # strict needs '#### ' with the space
])
def test_gsm8k_strict_vs_flexible(text, truth, strict, flexible):
    assert gsm8k.compute_score(text, truth) == strict
    assert gsm8k.compute_score(text, truth, method="flexible") == flexible


def test_gsm8k_strict_reads_only_the_tail():
    early = "#### 42\n" + "x" * 400 + "\nno final answer here"
    assert gsm8k.compute_score(early, "42") == 0.0
    assert gsm8k.compute_score(early, "42", method="flexible") == 1.0


def test_gsm8k_format_score_and_scale():
    assert gsm8k.compute_score("#### 3", "4", format_score=0.1) == 0.1
    assert gsm8k.compute_score("nothing", "4", format_score=0.1) == 0.0  # nothing found is not a format credit
    assert gsm8k.compute_score("#### 4", "4", score=2.0) == 2.0


def test_gsm8k_extract_answer():
    # '#### $2,500' does not fit the '#### N' pattern (the common rule), so the earlier answer is the last match
    assert gsm8k.extract_answer("a #### 1,000 b #### $2,500") == "1000"
    assert gsm8k.extract_answer("a #### 1,000 b #### 2,500") == "2500"
    assert gsm8k.extract_answer("no answer") is None
    assert gsm8k.extract_answer("it costs $1,200.", "flexible") == "1200"
    assert gsm8k.extract_answer("...", "flexible") is None
    with pytest.raises(ValueError, match="method"):
        gsm8k.extract_answer("#### 1", "loose")


# ------------------------------------------------------------------------------------------------ MATH on real data

@needs_data
def test_math500_reference_solutions_score_full():
    data = rows("math500/test.jsonl")
    assert len(data) == 500
    bad = [(r["unique_id"], r["answer"]) for r in data if math_reward.compute_score(r["solution"], r["answer"]) != 1.0]
    assert not bad, bad[:5]
    # the same through math-verify alone (no identical-string shortcut): the parser must handle every answer form
    bad = [(r["unique_id"], r["answer"]) for r in data
           if not math_reward.is_equiv(math_reward.extract_boxed(r["solution"]), r["answer"])]
    assert not bad, bad[:5]


@needs_data
def test_math500_wrong_answers_score_zero():
    data = rows("math500/test.jsonl")
    integers = [r for r in data if re.fullmatch(r"-?\d+", r["answer"].strip())]
    assert len(integers) > 200
    bad = [r["unique_id"] for r in integers
           if math_reward.compute_score(r["solution"], str(int(r["answer"]) + 1)) != 0.0]
    assert not bad, bad[:5]


# ------------------------------------------------------------------------------------------------ MATH edge cases

@pytest.mark.parametrize("text,boxed", [
    ("so \\boxed{5}.", "5"),
    ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),                 # nested braces
    ("first \\boxed{2}, finally \\boxed{3}", "3"),             # the last box wins
    ("\\boxed{\\boxed{1}}", "\\boxed{1}"),                     # outermost of nested boxes
    ("\\fbox{7}", "7"),
    ("$\\boxed 9$", "9"),                                      # \boxed with a bare argument
    ("\\boxed {4}", "4"),
    ("\\boxed{\\{1,2\\}}", "\\{1,2\\}"),                       # escaped braces do not count
    ("\\boxed{\\left[ 0, \\frac{\\pi}{2} \\right)}", "\\left[ 0, \\frac{\\pi}{2} \\right)"),
    ("\\boxed{5", None),                                       # unclosed
    ("the answer is 5", None),
    ("", None),
])
def test_extract_boxed(text, boxed):
    assert math_reward.extract_boxed(text) == boxed


@pytest.mark.parametrize("response,truth,expected", [
    ("\\boxed{0.5}", "\\frac{1}{2}", 1.0),                    # equal values in different notation
    ("\\boxed{\\dfrac12}", "\\frac{1}{2}", 1.0),
    ("\\boxed{(3,\\pi/2)}", "\\left( 3, \\frac{\\pi}{2} \\right)", 1.0),
    ("\\boxed{x^2+7x+10}", "x^2 + 7x + 10", 1.0),
    ("\\boxed{\\text{(C)}}", "\\text{(C)}", 1.0),
    ("$\\boxed 5$", "5", 1.0),
    ("\\fbox{7}", "7", 1.0),
    ("first \\boxed{2}, finally \\boxed{3}", "2", 0.0),      # an earlier box does not count
    ("\\boxed{\\frac{1}{3}}", "\\frac{1}{2}", 0.0),
    ("\\boxed{(3,\\pi)}", "\\left( 3, \\frac{\\pi}{2} \\right)", 0.0),
    ("\\boxed{[0, 1)}", "[0, 1]", 0.0),
    ("\\boxed{\\text{(B)}}", "\\text{(C)}", 0.0),
    ("\\boxed{2\\sqrt{3}}", "3\\sqrt{2}", 0.0),
    ("the answer is 5", "5", 0.0),                            # no box, no credit
    ("\\boxed{5", "5", 0.0),
    ("\\boxed{}", "5", 0.0),
    (None, "5", 0.0),                                         # never raises
    ("\\boxed{5}", None, 0.0),
    ("\\boxed{\\frac{", "\\frac{1}{2}", 0.0),
])
def test_math_compute_score(response, truth, expected):
    assert math_reward.compute_score(response, truth) == expected


def test_math_fractional_timeout_is_accepted():
    # signal.alarm takes whole seconds: a fractional timeout must not turn into an error (scored 0)
    assert math_reward.compute_score("\\boxed{0.5}", "\\frac{1}{2}", timeout_s=0.5) == 1.0


def test_math_scorer_works_outside_the_main_thread():
    # math-verify's signal.alarm timeout raises off the main thread; the scorer must switch it off there
    out = {}
    t = threading.Thread(target=lambda: out.update(
        right=math_reward.compute_score("\\boxed{0.5}", "\\frac{1}{2}"),  # needs math-verify, not string equality
        wrong=math_reward.compute_score("\\boxed{0.4}", "\\frac{1}{2}")))
    t.start()
    t.join(60)
    assert out == {"right": 1.0, "wrong": 0.0}


def test_math_extract_answer_normalises_whitespace():
    assert math_reward.extract_answer("so \\boxed{ x  +\n1 }") == "x + 1"
    assert math_reward.extract_answer("no box") is None


# ------------------------------------------------------------------------------------------------ dispatch

@pytest.mark.parametrize("source", ["openai/gsm8k", "gsm8k", "synthetic/arithmetic"])
def test_gsm8k_sources_use_strict(source):
    assert default_compute_score(source, "#### 1,234", "1234") == 1.0
    assert default_compute_score(source, "The answer is 1234", "1234") == 0.0  # strict, not flexible
    assert extract_answer_for(source, "x #### 12") == "12"


@pytest.mark.parametrize("source", ["DigitalLearningGmbH/MATH-lighteval", "lighteval/MATH", "HuggingFaceH4/MATH-500",
                                    "math", "math500"])
def test_math_sources_use_math_verify(source):
    assert default_compute_score(source, "\\boxed{0.5}", "\\frac{1}{2}", {"split": "test"}) == 1.0
    assert default_compute_score(source, "\\boxed{0.4}", "\\frac{1}{2}") == 0.0
    assert extract_answer_for(source, "\\boxed{\\frac{1}{2}}") == "\\frac{1}{2}"


def test_unknown_data_source_message():
    with pytest.raises(UnknownDataSourceError) as err:
        default_compute_score("foo", "#### 1", "1")
    assert isinstance(err.value, KeyError)
    msg = str(err.value)
    assert msg.startswith("no reward function for data_source 'foo'. Known: [")
    assert "'openai/gsm8k'" in msg and "'DigitalLearningGmbH/MATH-lighteval'" in msg
    assert ("Add one with custom_reward_function.path=my_reward.py custom_reward_function.name=compute_score, "
            "or register it with @posttrain.reward.register_scorer('foo')") in msg
    with pytest.raises(UnknownDataSourceError, match="'bar'"):
        extract_answer_for("bar", "text")


@pytest.fixture
def clean_registry(monkeypatch):
    monkeypatch.setattr(registry, "_SCORERS", dict(registry._SCORERS))
    monkeypatch.setattr(registry, "_EXTRACTORS", dict(registry._EXTRACTORS))


def test_register_scorer(clean_registry):
    @register_scorer("foo", "foo/v2", extract_answer=lambda text: text.split()[-1])
    def exact(solution_str, ground_truth, extra_info=None):
        return {"score": float(solution_str.strip().endswith(ground_truth)), "len": len(solution_str)}

    assert default_compute_score("foo", "it is yes", "yes") == {"score": 1.0, "len": 9}
    assert default_compute_score("foo/v2", "it is no", "yes")["score"] == 0.0
    assert extract_answer_for("foo", "it is yes") == "yes"
    assert "foo" in registry.known_data_sources()

    @register_scorer("bar")
    def no_extractor(solution_str, ground_truth, extra_info=None):
        return 0.0

    with pytest.raises(ValueError, match="extract_answer"):
        extract_answer_for("bar", "text")
    with pytest.raises(ValueError):
        register_scorer()


def test_register_scorer_can_override_a_builtin(clean_registry):
    with pytest.raises(ValueError, match=r"'gsm8k'\] already has a scorer; pass override=True"):
        register_scorer("gsm8k")(lambda s, gt, extra_info=None: 0.5)
    assert default_compute_score("gsm8k", "#### 1", "1") == 1.0  # the refused registration changed nothing
    register_scorer("gsm8k", override=True)(lambda s, gt, extra_info=None: 0.5)
    assert default_compute_score("gsm8k", "#### 1", "1") == 0.5
    assert default_compute_score("openai/gsm8k", "#### 1", "1") == 1.0  # other sources keep theirs


# ------------------------------------------------------------------------------------------------ custom reward files

def test_load_custom_reward_function(tmp_path):
    path = tmp_path / "my_reward.py"
    path.write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    return {'score': float(ground_truth in solution_str), 'source_len': len(data_source)}\n"
        "def other(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    return 0.25\n"
        "THRESHOLD = 3\n")
    fn = load_custom_reward_function(str(path), "compute_score")
    assert fn("abc", "the answer is 42", "42", {"split": "train"}) == {"score": 1.0, "source_len": 3}
    assert load_custom_reward_function(path, "other")("x", "y", "z") == 0.25

    with pytest.raises(AttributeError) as err:
        load_custom_reward_function(path, "missing_fn")
    assert "missing_fn" in str(err.value) and str(path) in str(err.value) and "compute_score" in str(err.value)
    with pytest.raises(TypeError, match="THRESHOLD"):
        load_custom_reward_function(path, "THRESHOLD")
    with pytest.raises(FileNotFoundError) as err:
        load_custom_reward_function(tmp_path / "nope.py", "compute_score")
    assert "nope.py" in str(err.value)


def test_load_custom_reward_function_propagates_import_errors(tmp_path):
    path = tmp_path / "broken.py"
    path.write_text("import definitely_not_a_module_xyz\n")
    with pytest.raises(ModuleNotFoundError):
        load_custom_reward_function(path, "compute_score")


# ------------------------------------------------------------------------------------------------ reasoning-gym

needs_rgym = pytest.mark.skipif(importlib.util.find_spec("reasoning_gym") is None,
                                reason="reasoning-gym is not installed (pip install 'posttrain[reasoning-gym]')")


def rgym_rows(task, n=4, seed=0, **options):
    """Rows as `posttrain prepare reasoning-gym` writes them, in this process, with the entries they came from."""
    import reasoning_gym

    from posttrain.data.preprocess.rgym import task_rows

    rows = task_rows(task, n, 0, seed, options, "default")["train"]
    dataset = reasoning_gym.create_dataset(task, size=n, seed=seed, **options)
    return rows, [dataset[i] for i in range(n)], dataset


def python_scalars(value):
    if isinstance(value, (list, tuple)):
        return type(value)(python_scalars(v) for v in value)
    if isinstance(value, dict):
        return {python_scalars(k): python_scalars(v) for k, v in value.items()}
    return value.item() if hasattr(value, "item") and not isinstance(value, (list, dict)) else value


@needs_rgym
@pytest.mark.parametrize("task", ["chain_sum", "gcd", "spell_backward", "complex_arithmetic", "knights_knaves",
                                  "futoshiki", "arc_agi", "graph_color", "acre"])
def test_reasoning_gym_entries_survive_the_row(task):
    """The entry a row carries decodes to the generated one, types included (tuples, integer keys): its checker
    gives every response the same score on either, the right answer full marks."""
    from posttrain.reward.rgym import decode_entry

    rows, entries, dataset = rgym_rows(task)
    for row, entry in zip(rows, entries):
        rebuilt = decode_entry(row["extra_info"]["entry"])
        # repr: a list where a tuple was would show (numpy strings and numbers are kept as the Python ones)
        assert rebuilt == entry and repr(rebuilt) == repr(python_scalars(entry))
        answer = entry["answer"]
        if answer is None:  # graph_color: no single answer; its metadata holds a valid colouring
            answer = json.dumps({str(k): v for k, v in entry["metadata"]["possible_answer"].items()})
        for text in (answer, answer + "0", "", "no"):
            assert dataset.score_answer(text, rebuilt) == dataset.score_answer(text, entry)
        assert default_compute_score(row["data_source"], f"so <answer>{answer}</answer>", row["reward_model"][
            "ground_truth"], row["extra_info"]) == {"score": 1.0, "acc": 1.0}


def test_reasoning_gym_entry_codec_round_trips_awkward_values():
    from posttrain.reward.rgym import decode_entry, encode_entry

    value = {"t": (1, (2, "x"), []), "k": {1: "a", (2, 3): [None, True, 1.5]}, "tag": {"__tuple__": [1]},
             "items": {"__items__": 0}, "plain": {"a": [1, {"b": ()}]}}
    back = decode_entry(encode_entry(value))
    assert back == value and repr(back) == repr(value)
    json.loads(encode_entry(value))  # plain JSON text
    with pytest.raises(TypeError, match="set"):
        encode_entry({"s": {1, 2}})


@needs_rgym
def test_reasoning_gym_scorer_reads_the_last_answer_tags():
    """The response's last <answer> is what the checker grades; no tags score 0; acc only for full marks
    (chain_sum's checker gives partial credit for a wrong number)."""
    rows, entries, dataset = rgym_rows("chain_sum", n=1, seed=3)
    row, truth = rows[0], entries[0]["answer"]
    info, source = row["extra_info"], row["data_source"]

    def score(text):
        return default_compute_score(source, text, truth, info)

    assert score(f"<answer>{int(truth) + 1}</answer> then <answer> {truth} </answer>") == {"score": 1.0, "acc": 1.0}
    assert score(f"<answer>{truth}</answer> then <answer>{int(truth) + 1}</answer>")["score"] < 1.0
    assert score(truth) == {"score": 0.0, "acc": 0.0}  # no tags, no answer
    wrong = str(int(truth) + 10)
    partial = score(f"<answer>{wrong}</answer>")
    assert partial == {"score": dataset.score_answer(wrong, entries[0]), "acc": 0.0}
    assert extract_answer_for(source, f"x <answer>{truth}</answer>") == truth  # majority voting reads the same


@needs_rgym
def test_reasoning_gym_scorer_failures_are_counted_errors(tiny_tokenizer):
    """A row without the entry, or an entry the checker cannot read, is an error the reward manager scores 0 and
    counts; the other rows score normally, in the training process and in scorer worker processes."""
    from posttrain.data.batch import Batch
    from posttrain.reward.manager import RewardManager

    rows, entries, _ = rgym_rows("chain_sum", n=3, seed=1)
    broken = dict(rows[2]["extra_info"], entry=json.dumps({"question": "q"}))  # no answer: the checker raises
    infos = [rows[0]["extra_info"], {"split": "train"}, broken]
    texts = [f"<answer>{e['answer']}</answer>" for e in entries]
    ids = [tiny_tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    width = max(map(len, ids))
    batch = Batch({"responses": torch.tensor([i + [0] * (width - len(i)) for i in ids]),
                   "response_mask": torch.tensor([[1] * len(i) + [0] * (width - len(i)) for i in ids])},
                  {"data_source": ["reasoning_gym/chain_sum"] * 3, "ground_truth": [e["answer"] for e in entries],
                   "extra_info": infos})
    for workers in (0, 1):
        rm = RewardManager(tiny_tokenizer, num_workers=workers)
        try:
            with pytest.warns(RuntimeWarning, match="reward function raised"):
                scores, extras = rm(batch)
        finally:
            rm.close()
        assert scores.sum(-1).tolist() == [1.0, 0.0, 0.0] and extras["errors"] == [0.0, 1.0, 1.0]
    with pytest.raises(ValueError, match=r"needs extra_info \['task', 'entry', 'options'\]"):
        default_compute_score("reasoning_gym/chain_sum", texts[1], "1", {"split": "train"})


@needs_rgym
def test_reasoning_gym_sources_are_checked_before_training(tiny_tokenizer):
    from posttrain.reward.manager import RewardManager

    rm = RewardManager(tiny_tokenizer)
    rm.check_data_sources(["reasoning_gym/chain_sum", "reasoning_gym/gcd", "openai/gsm8k"])
    with pytest.raises(ValueError, match="unknown reasoning-gym task 'chain_sun': did you mean chain_sum"):
        rm.check_data_sources(["reasoning_gym/chain_sun"])
    with pytest.raises(UnknownDataSourceError, match="'reasoning_gym/'"):
        rm.check_data_sources(["reasoning_gym/"])  # the family needs a task name
    assert registry.has_scorer("reasoning_gym/gcd") and not registry.has_scorer("reasoning_gym/nope")
    assert "reasoning_gym/<task>" in registry.known_data_sources()


def test_reasoning_gym_sources_without_the_package(monkeypatch):
    monkeypatch.setitem(sys.modules, "reasoning_gym", None)  # import reasoning_gym now raises ImportError
    with pytest.raises(ImportError, match=r"pip install 'posttrain\[reasoning-gym\]'"):
        registry.require_scorer("reasoning_gym/chain_sum")
    with pytest.raises(ImportError, match="reasoning_gym package, which is not installed"):
        default_compute_score("reasoning_gym/chain_sum", "<answer>1</answer>", "1",
                              {"task": "chain_sum", "entry": "{}", "options": "{}"})


def test_an_exact_registration_wins_over_the_reasoning_gym_family(clean_registry):
    register_scorer("reasoning_gym/mine")(lambda s, gt, extra_info=None: 0.25)
    assert default_compute_score("reasoning_gym/mine", "x", "y") == 0.25
