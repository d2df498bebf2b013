"""Rule scorers against the real benchmarks (every reference solution must get full marks) and hand-made edge cases,
plus data_source dispatch, user scorers and custom reward files."""

import json
import re
import threading
from pathlib import Path

import pytest

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
