"""The tool task: its calculator (exact, and safe on hostile text), its data, its scorer, and the tiny model's tool
chat template."""

import importlib.util
import json

import pytest

from posttrain.data.calculator import CalculatorError, calculate
from posttrain.data.synthetic_tools import (AGENT_NAME, DATA_SOURCE, DEFAULT_MIX, call_text, demonstration, estimate,
                                            kind_of, tokenizer_corpus, tool_schemas, wrong_operand, write_task)
from posttrain.reward.registry import default_compute_score
from posttrain.tiny.tools_task import TOOL_FILE, parse_call


@pytest.mark.parametrize("expression, value", [
    ("1234*567", 1234 * 567), ("(2+3)*-4", -20), ("7//2", 3), ("-7//2", -4), ("8/2", 4), ("+5 - 10", -5),
    (" 9999 * 9999 ", 9999 * 9999), ("((1))", 1), ("1_000*3", 3000)])
def test_calculator_values(expression, value):
    assert calculate(expression) == str(value)


def test_calculator_division_is_exact():
    assert calculate("7/2") == "7/2" and calculate("10/4") == "5/2" and calculate("-6/4") == "-3/2"
    with pytest.raises(CalculatorError, match="division by zero"):
        calculate("1/(2-2)")
    with pytest.raises(CalculatorError, match="division by zero"):
        calculate("5//0")


@pytest.mark.parametrize("hostile", [
    "9**9**9", "2**100000", "__import__('os').system('true')", "().__class__.__bases__", "open('/etc/passwd')",
    "[1]*10**9", "'a'*10", "1.5*2", "1e308*10", "True+1", "x", "lambda: 1", "1 if 1 else 2", "~1", "1<<100000",
    "1%0", "", "1\x00", "(" * 150 + "1" + ")" * 150, "9" * 41, "9" * 30 + "*" + "9" * 30, "1" * 201,
    "99999999999999999999*99999999999999999999*99999999999999999999", None, 12])
def test_calculator_refuses_hostile_text(hostile):
    """Anything but bounded integer arithmetic is a CalculatorError (a ValueError), raised at once: no code runs,
    no huge number is built."""
    with pytest.raises(CalculatorError):
        calculate(hostile)


def test_calculator_tool_file(tmp_path):
    """The function tool file serves the same calculator, under the schema the task's data renders."""
    pytest.importorskip("posttrain.tools", reason="posttrain.tools")
    from posttrain import tools

    if not hasattr(tools, "function_tool"):
        pytest.skip("posttrain.tools.function_tool is not there yet")
    from transformers.utils import get_json_schema

    spec = importlib.util.spec_from_file_location("calculator_tool_under_test", TOOL_FILE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    function = getattr(module.calculator, "__wrapped__", module.calculator)
    assert function("12*34") == "408"
    assert [get_json_schema(function)] == tool_schemas()


def test_task_rows(tmp_path):
    paths = write_task(tmp_path, seed=3, train=400, dev=50, held_out=60)
    rows = {name: [json.loads(line) for line in paths[name].read_text().splitlines()] for name in paths}
    assert [len(rows[n]) for n in ("sft_train", "sft_dev", "rl_train", "test")] == [400, 50, 400, 60]

    def problem(row):
        text = row["prompt"][0]["content"] if "prompt" in row else row["messages"][0]["content"]
        a, b = text.rstrip("=").split("*")
        return int(a), int(b)

    train, dev, test = ({problem(r) for r in rows[n]} for n in ("rl_train", "sft_dev", "test"))
    assert {problem(r) for r in rows["sft_train"]} == train and len(train) == 400
    assert not train & test and not train & dev and not dev & test
    for row in rows["test"]:
        a, b = problem(row)
        assert 100 <= a <= 9999 and 100 <= b <= 9999
        assert row["data_source"] == DATA_SOURCE and row["agent_name"] == AGENT_NAME
        assert row["reward_model"]["ground_truth"] == str(a * b) and row["prompt"] == [
            {"role": "user", "content": f"{a}*{b}="}]
        assert row["extra_info"]["kind"] == kind_of(a, b) and row["extra_info"]["tools_kwargs"] == {}
    kinds = [r["extra_info"]["kind"] for r in rows["rl_train"]]
    assert all(0.25 < kinds.count(kind) / 400 < 0.42 for kind in ("short", "mixed", "long"))


def test_demonstrations_mix_behaviours_by_kind(tmp_path):
    """Per kind, the demonstrations' behaviours come in the stated shares, and each behaviour's conversation is
    what it says: the right call and product, a call with a wrong last digit and the wrong product it returns, or
    a guess that is not the product."""
    paths = write_task(tmp_path, seed=0, train=3000, dev=10, held_out=10)
    rows = [json.loads(line) for line in paths["sft_train"].read_text().splitlines()]
    for kind, shares in DEFAULT_MIX.items():
        mine = [r for r in rows if r["extra_info"]["kind"] == kind]
        for behaviour, share in zip(("call", "wrong_call", "guess"), shares):
            seen = sum(r["behaviour"] == behaviour for r in mine) / len(mine)
            assert abs(seen - share) < 0.06, (kind, behaviour, seen, share)
    for row in rows[:300]:
        a, b = map(int, row["messages"][0]["content"].rstrip("=").split("*"))
        roles = [m["role"] for m in row["messages"]]
        final = row["messages"][-1]["content"]
        assert row["tools"] == tool_schemas()
        if row["behaviour"] == "guess":
            assert roles == ["user", "assistant"] and int(final) != a * b
        else:
            b_used = b if row["behaviour"] == "call" else wrong_operand(b)
            assert roles == ["user", "assistant", "tool", "assistant"]
            assert parse_call(row["messages"][1]["content"]) == f"{a}*{b_used}"
            assert row["messages"][2]["content"] == final == str(a * b_used)
            assert (int(final) == a * b) == (row["behaviour"] == "call")



def test_recheck_adds_a_swapped_second_call_and_leaves_the_rest(tmp_path):
    """`recheck`: about that share of the calling demonstrations calls the calculator a second time with the operands
    swapped (the same result) before the same answer; guesses never; every other draw — the problems, each row's
    behaviour and first call — is the task written without it."""
    plain = write_task(tmp_path / "plain", seed=0, train=2000, dev=10, held_out=10)
    checked = write_task(tmp_path / "checked", seed=0, train=2000, dev=10, held_out=10, recheck=0.3)
    rows = [json.loads(line) for line in checked["sft_train"].read_text().splitlines()]
    before = [json.loads(line) for line in plain["sft_train"].read_text().splitlines()]
    assert checked["rl_train"].read_text() == plain["rl_train"].read_text()
    assert checked["test"].read_text() == plain["test"].read_text()
    calling = [(r, p) for r, p in zip(rows, before) if p["behaviour"] != "guess"]
    rechecked = [(r, p) for r, p in calling if r["behaviour"].endswith("+recheck")]
    assert abs(len(rechecked) / len(calling) - 0.3) < 0.04
    assert all(r == p for r, p in zip(rows, before) if p["behaviour"] == "guess")
    for row, was in rechecked:
        first, result = row["messages"][1]["content"], row["messages"][2]["content"]
        assert row["behaviour"] == was["behaviour"] + "+recheck"
        assert [m["role"] for m in row["messages"]] == ["user", "assistant", "tool", "assistant", "tool", "assistant"]
        assert row["messages"][:3] == was["messages"][:3]
        a, b = parse_call(first).split("*")
        assert parse_call(row["messages"][3]["content"]) == f"{b}*{a}"
        assert row["messages"][4]["content"] == row["messages"][5]["content"] == result

def test_wrong_operand_and_estimate():
    assert [wrong_operand(b) for b in (123, 129, 4560, 9999)] == [124, 120, 4561, 9990]
    assert estimate(1234, 5678) == 1200 * 5700 and estimate(100, 100) == 100 * 100 + 1
    assert call_text("1*2") == '<tool_call>{"name": "calculator", "arguments": {"expression": "1*2"}}</tool_call>'


@pytest.mark.parametrize("solution, extra, score", [
    ("699678", None, 1.0),  # single turn
    (" 699678.\n", None, 1.0),
    ("699,678", None, 0.0),
    ("The answer is 699678", None, 0.0),
    ('<tool_call>{"name": "calculator", "arguments": {"expression": "1234*567"}}</tool_call>\nuser\n<tool_response>\n'
     "699678\n</tool_response>\nassistant\n699678", None, 1.0),
    # the product only in the tool's result does not count
    ('<tool_call>{"name": "calculator", "arguments": {"expression": "1234*567"}}</tool_call>\nuser\n<tool_response>\n'
     "699678\n</tool_response>\nassistant\n699679", None, 0.0),
    ('<tool_call>{"name": "calculator", "arguments": {"expression": "1234*567"}}</tool_call>\nuser\n<tool_response>\n'
     "699678\n</tool_response>", None, 0.0),
    # with the episode's messages, the last assistant message is the answer
    ("ignored", {"messages": [{"role": "user", "content": "1234*567="},
                              {"role": "assistant", "content": call_text("1234*567")},
                              {"role": "tool", "content": "699678"}, {"role": "assistant", "content": "699678"}]}, 1.0),
    ("699678", {"messages": [{"role": "user", "content": "1234*567="},
                             {"role": "assistant", "content": call_text("1234*567")},
                             {"role": "tool", "content": "699678"}]}, 0.0),  # ended on a call: no answer
    ("699678", {"messages": [{"role": "user", "content": "1234*567="}]}, 0.0),
])
def test_scorer_reads_the_final_answer(solution, extra, score):
    assert default_compute_score(DATA_SOURCE, solution, "699678", extra) == score


def test_tool_template_renders_qwen_layout():
    from posttrain.models.tiny import CHAT_TEMPLATE, TOOL_TOKENS, build_tokenizer

    tok = build_tokenizer(tokenizer_corpus(0, 200), tools=True)
    messages = [{"role": "system", "content": "Be exact."}, *demonstration(12, 34, "call"),
                {"role": "user", "content": "again"}, {"role": "assistant", "content": None, "tool_calls": [
                    {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "1+1"}}}]},
                {"role": "tool", "content": "2"}, {"role": "tool", "content": "3"}]
    text = tok.apply_chat_template(messages, tools=tool_schemas(), tokenize=False, add_generation_prompt=True)
    assert text == ("<|im_start|>system\nBe exact.\nTools: calculator(expression)<|im_end|>\n"
                    "<|im_start|>user\n12*34=<|im_end|>\n"
                    f"<|im_start|>assistant\n{call_text('12*34')}<|im_end|>\n"
                    "<|im_start|>user\n<tool_response>\n408\n</tool_response><|im_end|>\n"
                    "<|im_start|>assistant\n408<|im_end|>\n"
                    "<|im_start|>user\nagain<|im_end|>\n"
                    f"<|im_start|>assistant\n{call_text('1+1')}<|im_end|>\n"
                    "<|im_start|>user\n<tool_response>\n2\n</tool_response>\n<tool_response>\n3\n</tool_response>"
                    "<|im_end|>\n<|im_start|>assistant\n")
    no_tools = tok.apply_chat_template(messages[:2], tokenize=False)
    assert no_tools == "<|im_start|>system\nBe exact.<|im_end|>\n<|im_start|>user\n12*34=<|im_end|>\n"
    for marker in TOOL_TOKENS:  # one token each, kept by decoding that skips special tokens
        ids = tok(f"a{marker}b", add_special_tokens=False)["input_ids"]
        assert tok.convert_ids_to_tokens(ids[1]) == marker and len(ids) == 3
        assert tok.decode(ids, skip_special_tokens=True) == f"a{marker}b"
    plain = build_tokenizer(tokenizer_corpus(0, 200))
    assert plain.chat_template == CHAT_TEMPLATE and "<tool_call>" not in plain.get_vocab()


def test_tool_tokenizer_survives_a_reload(tmp_path):
    """A saved tiny model with tools reloads as Qwen2Tokenizer with the same ids and template."""
    from posttrain.models.load import load_tokenizer
    from posttrain.models.tiny import build_tiny_model

    path = build_tiny_model(tmp_path, tokenizer_corpus(0, 200), hidden_size=16, num_layers=1, num_heads=2,
                            num_kv_heads=1, intermediate_size=16, tools=True)
    tok = load_tokenizer(str(path))
    talk = demonstration(1234, 567, "call")
    ids = tok.apply_chat_template(talk, tools=tool_schemas(), tokenize=True)
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    assert tok.convert_tokens_to_ids("<tool_call>") in ids
    assert tok.decode(ids, skip_special_tokens=True).count("<tool_response>") == 1


@pytest.mark.parametrize("text, expression", [
    (call_text("12*34"), "12*34"), ("so " + call_text("1+1") + call_text("2+2"), "1+1"),
    ('<tool_call>\n{"name": "calculator", "arguments": {"expression": "5"}}\n</tool_call>', "5"),
    ("408", None), ("<tool_call>[1]</tool_call>", None), ('<tool_call>{"name": "calculator"</tool_call>', None),
    ('<tool_call>{"name": "search", "arguments": {"expression": "1"}}</tool_call>', None),
    ('<tool_call>{"name": "calculator", "arguments": {"expression": 5}}</tool_call>', None),
    ('<tool_call>{"name": "calculator", "arguments": "1+1"}</tool_call>', None),
    ('<tool_call>{"name": "calculator", "arguments": {"expression": "1"}}', None)])
def test_parse_call(text, expression):
    assert parse_call(text) == expression


def test_right_first_calls_are_judged_against_the_prompts_product():
    """A first call is right when its expression's value is the product the prompt asks for, whatever the record's
    ground truth holds (a verifiers environment's is a task key); a later right call, a wrong operand, a bad
    expression or a record without a problem is not."""
    from posttrain.tiny.tools_task import correct_call_share

    def record(first, *later, user="12*34=", truth="408"):
        said = [{"role": "assistant", "content": text} for text in (first, *later)]
        return {"ground_truth": truth, "messages": ([{"role": "user", "content": user}] if user else []) + said}

    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "%s"}}</tool_call>'
    assert correct_call_share([record(call % "12*34"), record(call % "34*12", truth="3f9a0c")]) == 1.0
    assert correct_call_share([record(call % "12*35"), record("408", call % "12*34"), record(call % "12**34"),
                               record(call % "1", user="")]) == 0.0
    assert correct_call_share([record(call % "12*34"), record(call % "12*35")]) == 0.5
