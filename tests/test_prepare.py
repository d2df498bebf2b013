"""`prepare`: original GSM8K / MATH files -> train/test files in the RL data layout, and its input errors."""

import importlib.util
import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from posttrain.data.preprocess import find_shared_data, prepare
from posttrain.data.preprocess import gsm8k as gsm8k_pre
from posttrain.data.preprocess import math as math_pre
from posttrain.reward.registry import default_compute_score

ROOT = Path(__file__).resolve().parents[1]
DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
needs_data = pytest.mark.skipif(not DATA.is_dir(), reason=f"shared benchmark data not found at {DATA}")
COLUMNS = ["data_source", "prompt", "ability", "reward_model", "extra_info"]

GSM8K_Q0 = ("Janet\u2019s ducks lay 16 eggs per day. She eats three for breakfast every morning and bakes muffins for her "
            "friends every day with four. She sells the remainder at the farmers' market daily for $2 per fresh duck "
            "egg. How much in dollars does she make every day at the farmers' market?")
GSM8K_A0 = ("Janet sells 16 - 3 - 4 = <<16-3-4=9>>9 duck eggs a day.\nShe makes 9 * 2 = $<<9*2=18>>18 every day at the "
            "farmer\u2019s market.\n#### 18")


@needs_data
def test_prepare_gsm8k_parquet(tmp_path):
    summary = prepare("gsm8k", DATA / "gsm8k", tmp_path)
    assert summary == {"train": (tmp_path / "train.parquet", 7473), "test": (tmp_path / "test.parquet", 1319)}
    table = pq.read_table(tmp_path / "test.parquet")
    assert table.column_names == COLUMNS
    assert table.num_rows == 1319
    rows = table.to_pylist()
    assert rows[0] == {
        "data_source": "openai/gsm8k",
        "prompt": [{"role": "user", "content": GSM8K_Q0 + ' Let\'s think step by step and output the final answer '
                                                          'after "####".'}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": "18"},
        "extra_info": {"split": "test", "index": 0, "answer": GSM8K_A0, "question": GSM8K_Q0},
    }
    assert [r["extra_info"]["index"] for r in rows] == list(range(1319))
    # ground truths are bare numbers (commas stripped) and the rows score through the default dispatch
    assert all("," not in r["reward_model"]["ground_truth"] for r in rows)
    assert all(default_compute_score(r["data_source"], r["extra_info"]["answer"], r["reward_model"]["ground_truth"],
                                     r["extra_info"]) == 1.0 for r in rows)
    train = pq.read_table(tmp_path / "train.parquet")
    assert train.column_names == COLUMNS
    assert train.slice(0, 1).to_pylist()[0]["extra_info"]["split"] == "train"


@needs_data
def test_prepare_math_only_test_split(tmp_path):
    summary = prepare("math", DATA / "math500" / "test.jsonl", tmp_path, fmt="both")
    assert summary == {"train": (None, 0), "test": (tmp_path / "test.parquet", 500)}  # MATH-500 has no train split
    assert not (tmp_path / "train.parquet").exists()
    table = pq.read_table(tmp_path / "test.parquet")
    assert table.column_names == COLUMNS
    first = table.slice(0, 1).to_pylist()[0]
    original = json.loads((DATA / "math500" / "test.jsonl").open().readline())
    assert first == {
        "data_source": "DigitalLearningGmbH/MATH-lighteval",
        "prompt": [{"role": "user", "content": original["problem"] + " Let's think step by step and output the final "
                                                                    "answer within \\boxed{}."}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": "\\left( 3, \\frac{\\pi}{2} \\right)"},
        "extra_info": {"split": "test", "index": 0, "answer": original["solution"], "question": original["problem"]},
    }
    jsonl = [json.loads(line) for line in (tmp_path / "test.jsonl").open()]
    assert len(jsonl) == 500 and jsonl[0] == first


GSM8K_TOOL_SYSTEM = ("You are a math expert. You are given a question and you need to solve it step by step. "
                     "Reasoning step by step before any tool call. You should use the `calc_gsm8k_reward` tool after "
                     "step by step solving the question, before generate final answer at least once and refine your "
                     "answer if necessary. Put your final answer in the format of `#### <answer>`.")


@needs_data
def test_prepare_gsm8k_tool_agent_layout(tmp_path, monkeypatch, tiny_tokenizer):
    """`prepare gsm8k --tools` writes the familiar GSM8K tool-agent rows: agent_name tool_agent, the system prompt
    offering calc_gsm8k_reward, and that tool's create arguments (the ground truth) in extra_info.tools_kwargs; they
    still score through the GSM8K scorer and load as prompts naming their environment."""
    from posttrain.cli import main
    from posttrain.data.dataset import RLDataset

    monkeypatch.chdir(tmp_path)
    assert main(["prepare", "gsm8k", "--tools", "--input", str(DATA / "gsm8k")]) == 0
    out = tmp_path / "data" / "gsm8k_tools"  # beside, not over, the single-turn files
    rows = pq.read_table(out / "test.parquet").to_pylist()
    assert len(rows) == 1319 and pq.read_metadata(out / "train.parquet").num_rows == 7473
    assert list(rows[0]) == ["data_source", "agent_name", "prompt", "ability", "reward_model", "extra_info"]
    assert rows[0] == {
        "data_source": "openai/gsm8k",
        "agent_name": "tool_agent",
        "prompt": [{"role": "system", "content": GSM8K_TOOL_SYSTEM},
                   {"role": "user", "content": GSM8K_Q0 + " Let's think step by step and output the final answer "
                                                          "after `####`."}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": "18"},
        "extra_info": {"split": "test", "index": 0, "answer": GSM8K_A0, "question": GSM8K_Q0,
                       "need_tools_kwargs": True,
                       "tools_kwargs": {"calc_gsm8k_reward": {"create_kwargs": {"ground_truth": "18"}}}},
    }
    assert all(r["extra_info"]["tools_kwargs"]["calc_gsm8k_reward"]["create_kwargs"]["ground_truth"]
               == r["reward_model"]["ground_truth"] for r in rows)
    assert all(default_compute_score(r["data_source"], r["extra_info"]["answer"], r["reward_model"]["ground_truth"],
                                     r["extra_info"]) == 1.0 for r in rows)
    items = RLDataset(str(out / "test.parquet"), tiny_tokenizer, max_prompt_length=4096, max_samples=3)
    assert [it.agent_name for it in items] == ["tool_agent"] * 3
    assert items[0].extra_info["tools_kwargs"] == {"calc_gsm8k_reward": {"create_kwargs": {"ground_truth": "18"}}}


@needs_data
def test_prepare_math_code_interpreter_layout(tmp_path):
    summary = prepare("math", DATA / "math500", tmp_path, fmt="jsonl", tools=True)
    assert summary == {"train": (None, 0), "test": (tmp_path / "test.jsonl", 500)}
    first = json.loads((tmp_path / "test.jsonl").open().readline())
    original = json.loads((DATA / "math500" / "test.jsonl").open().readline())
    truth = "\\left( 3, \\frac{\\pi}{2} \\right)"
    assert first == {
        "data_source": "DigitalLearningGmbH/MATH-lighteval",
        "agent_name": "tool_agent",
        "prompt": [{"role": "system", "content": "You are a math expert. You are given a question and you need to "
                                                 "solve it step by step. You may use the `code_interpreter` tool to "
                                                 "run Python code for any calculation; it returns what the code "
                                                 "prints. Put your final answer within \\boxed{}."},
                   {"role": "user", "content": original["problem"] + " Let's think step by step and output the "
                                                                     "final answer within \\boxed{}."}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": truth},
        "extra_info": {"split": "test", "index": 0, "answer": original["solution"], "question": original["problem"],
                       "need_tools_kwargs": True,
                       "tools_kwargs": {"code_interpreter": {"create_kwargs": {"ground_truth": truth}}}},
    }


def test_math_ground_truth_falls_back_to_last_box(tmp_path):
    src = tmp_path / "train.jsonl"
    src.write_text(json.dumps({"problem": "1+1?", "solution": "First \\boxed{3}, no: $\\boxed{\\frac{4}{2}}$."}) + "\n"
                   + json.dumps({"problem": "2+2?", "solution": "it is \\boxed{4}", "answer": "4"}) + "\n")
    rows = math_pre.convert(src, "train")
    assert [r["reward_model"]["ground_truth"] for r in rows] == ["\\frac{4}{2}", "4"]
    assert [r["extra_info"]["index"] for r in rows] == [0, 1]


def test_prepare_jsonl_from_an_explicit_folder(tmp_path):
    src = tmp_path / "in"
    src.mkdir()
    (src / "train.jsonl").write_text(json.dumps({"question": "How many?", "answer": "2+2=4\n#### 1,004"}) + "\n\n")
    summary = prepare("gsm8k", src, tmp_path / "out", fmt="jsonl")
    assert summary == {"train": (tmp_path / "out" / "train.jsonl", 1), "test": (None, 0)}
    row = json.loads((tmp_path / "out" / "train.jsonl").read_text())
    assert list(row) == COLUMNS
    assert row["reward_model"] == {"style": "rule", "ground_truth": "1004"}


def test_bad_json_line_names_file_and_line(tmp_path):
    src = tmp_path / "test.jsonl"
    good = json.dumps({"question": "q", "answer": "a\n#### 1"})
    src.write_text(f"{good}\n{good}\n{{not json\n")
    with pytest.raises(ValueError) as err:
        prepare("gsm8k", src, tmp_path / "out")
    assert str(src) in str(err.value) and "line 3" in str(err.value)
    assert not (tmp_path / "out" / "test.parquet").exists()  # nothing written from a bad input


def test_rows_without_an_answer_are_named(tmp_path):
    src = tmp_path / "test.jsonl"
    src.write_text(json.dumps({"question": "q", "answer": "a\n#### 1"}) + "\n"
                   + json.dumps({"question": "q", "answer": "no final line"}) + "\n")
    with pytest.raises(ValueError, match=r"line 2.*####"):
        gsm8k_pre.convert(src, "test")
    src.write_text(json.dumps({"problem": "p", "solution": "no box"}) + "\n")
    with pytest.raises(ValueError, match=r"line 1.*boxed"):
        math_pre.convert(src, "test")
    src.write_text(json.dumps({"problem": "p"}) + "\n")
    with pytest.raises(ValueError, match=r"line 1.*'solution'"):
        math_pre.convert(src, "test")


def test_missing_input_names_the_path(tmp_path):
    missing = tmp_path / "nope" / "train.jsonl"
    with pytest.raises(FileNotFoundError, match=str(missing)):
        prepare("gsm8k", missing, tmp_path / "out")
    with pytest.raises(FileNotFoundError, match="test.jsonl"):
        prepare("math", tmp_path, tmp_path / "out")  # a folder with no input files in it
    with pytest.raises(FileNotFoundError, match=str(missing)):
        gsm8k_pre.convert(missing, "train")


def test_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="unknown dataset"):
        prepare("mmlu", tmp_path)
    with pytest.raises(ValueError, match="unknown format"):
        prepare("gsm8k", tmp_path, fmt="csv")
    with pytest.raises(ValueError, match=r"layout \(--tools\) is written for \['gsm8k', 'math'\], not 'code'"):
        prepare("code", tmp_path, tools=True)


@needs_data
def test_default_input_is_the_shared_data(tmp_path, monkeypatch):
    assert find_shared_data() == DATA  # found from the package location whatever the CWD
    monkeypatch.chdir(tmp_path)
    summary = prepare("math")  # default input and default output dir data/math under the CWD
    assert summary["test"] == (Path("data") / "math" / "test.parquet", 500)
    assert (tmp_path / "data" / "math" / "test.parquet").is_file()


# ------------------------------------------------------------------------------------------------ reasoning-gym

needs_rgym = pytest.mark.skipif(importlib.util.find_spec("reasoning_gym") is None,
                                reason="reasoning-gym is not installed (pip install 'posttrain[reasoning-gym]')")


def cli(*args, env=None):
    import os

    return subprocess.run([sys.executable, "-m", "posttrain", *args], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}, cwd=ROOT)


@needs_rgym
def test_prepare_reasoning_gym_rows(tmp_path):
    """Each task's rows: its data_source, reasoning-gym's default system prompt and the question, the answer as
    ground truth (re-derived here from the question), the whole entry in extra_info; test questions never repeat
    training ones."""
    from reasoning_gym.utils import SYSTEM_PROMPTS

    from posttrain.data.preprocess.rgym import prepare_reasoning_gym
    from posttrain.reward.rgym import decode_entry

    summary = prepare_reasoning_gym("chain_sum,gcd", 30, 7, tmp_path, test_size=6)
    assert summary == {"train": (tmp_path / "train.parquet", 60), "test": (tmp_path / "test.parquet", 12)}
    train, test = (pq.read_table(tmp_path / f"{s}.parquet") for s in ("train", "test"))
    assert train.column_names == COLUMNS
    rows = {split: t.to_pylist() for split, t in (("train", train), ("test", test))}
    for split, part in rows.items():
        assert [r["data_source"] for r in part] == (["reasoning_gym/chain_sum"] * (len(part) // 2)
                                                   + ["reasoning_gym/gcd"] * (len(part) // 2))
        for r in part:
            info, question = r["extra_info"], r["prompt"][1]["content"]
            assert r["prompt"][0] == {"role": "system", "content": SYSTEM_PROMPTS["default"]}
            assert info["split"] == split and info["task"] == r["data_source"].split("/")[1]
            assert json.loads(info["options"]) == {"seed": 7, "size": 90}  # 30 + 10 draws per test row asked for
            entry = decode_entry(info["entry"])
            assert entry["question"] == question and entry["answer"] == r["reward_model"]["ground_truth"]
            if info["task"] == "chain_sum":  # "... problem: 12 + 7 - 3 =": the sum
                expression = question.split(":")[1].rstrip("= ")
                assert int(r["reward_model"]["ground_truth"]) == eval(expression, {})
            else:  # "... of these numbers: 780, 461. Give only ...": their greatest common divisor
                numbers = [int(n) for n in re.findall(r"\d+", question.split(":")[1].split(".")[0])]
                assert int(r["reward_model"]["ground_truth"]) == math.gcd(*numbers)
    for task in ("chain_sum", "gcd"):
        seen = {r["prompt"][1]["content"] for r in rows["train"] if r["extra_info"]["task"] == task}
        held_out = [r["prompt"][1]["content"] for r in rows["test"] if r["extra_info"]["task"] == task]
        assert len(set(held_out)) == 6 and not seen & set(held_out)
        assert [r["extra_info"]["index"] for r in rows["test"] if r["extra_info"]["task"] == task] == list(range(6))


@needs_rgym
def test_prepare_reasoning_gym_options_and_prompt(tmp_path):
    """--task-option sets the task's config (kept in the row for the scorer); --system-prompt none puts the tag
    instruction in the question's turn; a task space too small for the test split asked for is an error."""
    from posttrain.data.preprocess.rgym import TAG_INSTRUCTION, prepare_reasoning_gym

    opts = ["max_terms=2", "min_digits=2", "max_digits=2"]
    prepare_reasoning_gym("chain_sum", 20, 1, tmp_path, fmt="jsonl", options=opts, system="none")
    rows = [json.loads(line) for line in (tmp_path / "train.jsonl").read_text().splitlines()]
    assert len(rows) == 20 and all(len(r["prompt"]) == 1 and r["prompt"][0]["role"] == "user" for r in rows)
    for r in rows:
        text = r["prompt"][0]["content"]
        assert text.endswith(TAG_INSTRUCTION)
        assert re.fullmatch(r".*: \d\d [+-] \d\d =", text[:-len(TAG_INSTRUCTION)])
    assert json.loads(rows[0]["extra_info"]["options"]) == {"max_terms": 2, "min_digits": 2, "max_digits": 2,
                                                            "seed": 1, "size": 40}
    with pytest.raises(ValueError, match="chain_sum: only .* differ from the training ones"):
        # one one-digit term: 10 problems, 5 training draws, 8 distinct others asked for
        prepare_reasoning_gym("chain_sum", 5, 0, tmp_path / "small", test_size=8,
                              options=["min_terms=1", "max_terms=1", "max_digits=1"])
    assert not (tmp_path / "small").exists()


@needs_rgym
def test_prepare_reasoning_gym_is_deterministic(tmp_path):
    """The same command writes byte-identical files, also for tasks whose generator follows the order of Python's
    string sets (word_ladder, isomorphic_strings), whatever the hash seed of the process that runs it."""
    args = ["prepare", "reasoning-gym", "word_ladder,isomorphic_strings,chain_sum", "--size", "6", "--seed", "3",
            "--format", "both"]
    for name, hash_seed in (("a", "1"), ("b", "2")):
        done = cli(*args, "--output-dir", str(tmp_path / name), env={"PYTHONHASHSEED": hash_seed})
        assert done.returncode == 0, done.stderr
        assert "train: 18 rows" in done.stdout and "test: 3 rows" in done.stdout
    for split in ("train", "test"):
        for ext in ("parquet", "jsonl"):
            assert (tmp_path / "a" / f"{split}.{ext}").read_bytes() == (tmp_path / "b" / f"{split}.{ext}").read_bytes()
    from posttrain.data.preprocess.rgym import prepare_reasoning_gym

    prepare_reasoning_gym("word_ladder,isomorphic_strings,chain_sum", 6, 4, tmp_path / "c")
    assert (tmp_path / "c" / "train.parquet").read_bytes() != (tmp_path / "a" / "train.parquet").read_bytes()


@needs_rgym
@pytest.mark.parametrize("args, message", [
    (["chain_sun", "--size", "5"], "unknown reasoning-gym task 'chain_sun': did you mean chain_sum"),
    (["chain_sum,chain_sum", "--size", "5"], r"task \['chain_sum'\] named more than once"),
    (["chain_sum,", "--size", "5"], "name the reasoning-gym tasks as TASK"),
    (["chain_sum", "--size", "0"], "--size must be an integer >= 1, got 0"),
    (["chain_sum", "--size", "5", "--seed", "-1"], "--seed must be an integer >= 0, got -1"),
    (["chain_sum", "--size", "5", "--test-size", "-2"], "--test-size must be an integer >= 0, got -2"),
    (["chain_sum"], "usage: posttrain prepare reasoning-gym TASK"),
    (["--size", "5"], "usage: posttrain prepare reasoning-gym TASK"),
    (["chain_sum", "--size", "5", "--task-option", "max_termz=2"], r"chain_sum has no option \['max_termz'\]"),
    (["chain_sum", "--size", "5", "--task-option", "max_terms=0"], "chain_sum rejects the options"),
    (["chain_sum", "--size", "5", "--task-option", "seed=3"], "seed is set by --seed"),
    (["chain_sum,gcd", "--size", "5", "--task-option", "max_terms=2"], "write TASK.KEY=VALUE"),
    (["chain_sum", "--size", "5", "--system-prompt", "chatty"], "unknown system prompt 'chatty'"),
])
def test_prepare_reasoning_gym_bad_arguments(tmp_path, args, message, capsys):
    from posttrain.cli import main

    assert main(["prepare", "reasoning-gym", *args, "--output-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert re.search(message, err[-1]), err
    assert not any(tmp_path.iterdir())  # nothing written


def test_prepare_reasoning_gym_without_the_package(tmp_path, monkeypatch):
    """Without reasoning_gym installed the error says how to install it."""
    from posttrain.data.preprocess.rgym import prepare_reasoning_gym

    monkeypatch.setitem(sys.modules, "reasoning_gym", None)  # import reasoning_gym now raises ImportError
    with pytest.raises(ImportError, match=r"pip install 'posttrain\[reasoning-gym\]'"):
        prepare_reasoning_gym("chain_sum", 5, 0, tmp_path)
    from posttrain.cli import main

    assert main(["prepare", "gsm8k", "chain_sum"]) == 2  # task names are for reasoning-gym only
