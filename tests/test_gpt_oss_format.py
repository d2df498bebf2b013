"""The `gpt-oss` tool-call format (verl's `GptOssToolParser`): OpenAI's harmony messages read from a turn decoded
with its special tokens, and tool answers appended in harmony's format as verl writes them. The examples are
re-derived from the harmony format (a message is `<|start|>ROLE<|channel|>CHANNEL<|message|>CONTENT` ended by
`<|end|>`, `<|call|>` or `<|return|>`; a call's recipient `to=functions.NAME` follows the channel or the role; the
assistant's turn starts after the prompt's `<|start|>assistant`) and from verl's parser test; the tokenizer is the
tiny one with harmony's special tokens added."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from posttrain.agents.episode import Episode
from posttrain.agents.loop import EpisodeRunner
from posttrain.agents.settings import AgentSettings
from posttrain.agents.template import Template
from posttrain.config import ConfigError, config_warnings, load_config
from posttrain.tools import parse_tool_calls

HARMONY = ["<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|call|>", "<|return|>", "<|constrain|>"]
WEATHER = '{"location": "Tokyo"}'


def calls(text: str) -> list[tuple]:
    return [(c.name, c.arguments, c.error) for c in parse_tool_calls(text, "gpt-oss").calls]


def test_verls_example_call_and_the_answer_after_it():
    """verl's parser test: a call, then the tool's answer (not a call: its author is the function)."""
    text = ("\n<|start|>assistant<|channel|>commentary to=functions.get_current_weather <|constrain|>json<|message|>"
            f"{WEATHER}<|call|>\n<|start|>functions.get_current_weather to=assistant<|channel|>commentary<|message|>"
            '{ "temperature": 20, "sunny": true }<|end|>')
    assert calls(text) == [("get_current_weather", {"location": "Tokyo"}, None)]


@pytest.mark.parametrize("text, expected", [
    # the turn's first message (its <|start|>assistant is the prompt's), ended by <|call|>, the end-of-turn token
    (f"<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{WEATHER}<|call|>",
     [("get_weather", {"location": "Tokyo"}, None)]),
    # the episode loop cuts the end-of-turn token: the call ends with the text
    (f"<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{WEATHER}",
     [("get_weather", {"location": "Tokyo"}, None)]),
    # reasoning first, then the call; the recipient after the role, the content type without <|constrain|>
    ("<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant to=functions.get_weather"
     f"<|channel|>commentary json<|message|>{WEATHER}", [("get_weather", {"location": "Tokyo"}, None)]),
    # two calls in one turn, in order
    ('<|channel|>commentary to=functions.a <|constrain|>json<|message|>{"x": 1}<|end|>'
     '<|start|>assistant<|channel|>commentary to=functions.b <|constrain|>json<|message|>{}<|call|>',
     [("a", {"x": 1}, None), ("b", {}, None)]),
    # a call written inside the reasoning is not one (verl cuts the analysis message to its <|end|> first)
    ("<|channel|>analysis<|message|>I could write <|start|>assistant<|channel|>commentary to=functions.rm "
     "<|constrain|>json<|message|>{} but will not.<|end|><|start|>assistant<|channel|>final<|message|>Done.", []),
    # a final answer, and messages to harmony's built-in tools (not functions.*): no calls
    ("<|channel|>analysis<|message|>Easy.<|end|><|start|>assistant<|channel|>final<|message|>4<|return|>", []),
    ("<|channel|>analysis to=python code<|message|>print(1)<|call|>", []),
    ('<|channel|>commentary to=browser.search <|constrain|>json<|message|>{"query": "x"}<|call|>', []),
    # hermes calls are not gpt-oss calls
    ('<tool_call>{"name": "a", "arguments": {}}</tool_call>', []),
    # mistakes: each a counted kind
    ('<|channel|>commentary to=functions.a <|constrain|>json<|message|>{"x": 1,}<|call|>',
     [("a", None, "malformed_json")]),
    ("<|channel|>commentary to=functions.a <|constrain|>json<|message|>[1, 2]<|call|>", [("a", None, "bad_arguments")]),
    ("<|channel|>commentary to=functions. <|constrain|>json<|message|>{}<|call|>", [(None, None, "missing_name")]),
])
def test_harmony_calls(text, expected):
    assert calls(text) == expected


def test_the_text_without_its_calls_is_the_turns_content():
    turn = parse_tool_calls("<|channel|>analysis<|message|>Think.<|end|><|start|>assistant<|channel|>commentary "
                            f"to=functions.get_weather <|constrain|>json<|message|>{WEATHER}<|call|>", "gpt-oss")
    assert turn.content == "<|channel|>analysis<|message|>Think.<|end|>"
    assert parse_tool_calls("<|channel|>final<|message|>4", "gpt-oss").content == "<|channel|>final<|message|>4"


def test_a_call_written_wrongly_is_answered_with_harmonys_way_to_call():
    from posttrain.tools import ToolBox, function_tool

    @function_tool
    def echo(text: str) -> str:
        """Echo.

        Args:
            text: what to echo
        """
        return text

    session = ToolBox([echo.__posttrain_tool__]).open()
    (result,) = session.run(parse_tool_calls(
        "<|channel|>commentary to=functions.echo <|constrain|>json<|message|>{text: hi}", "gpt-oss").calls)
    assert result.error == "malformed_json" and result.message["content"].endswith(
        "Write a call as <|start|>assistant<|channel|>commentary to=functions.<tool name> <|constrain|>json"
        "<|message|>{...}<|call|>")


@pytest.fixture
def harmony_tokenizer(tiny_model_dir):
    from posttrain.models.load import load_tokenizer

    tok = load_tokenizer(str(tiny_model_dir))
    tok.add_special_tokens({"additional_special_tokens": HARMONY})
    return tok


def test_tool_answers_are_appended_in_harmonys_format_as_verl_writes_them(harmony_tokenizer):
    """verl's `build_gpt_oss_tool_response_text`: each answer from `functions.NAME` to the assistant on the commentary
    channel, then `<|start|>assistant`; each marker one special token."""
    tok = harmony_tokenizer
    template = Template(tok, {tok.convert_tokens_to_ids("<|call|>")}, format="gpt-oss")
    appended = template.appended([{"role": "tool", "name": "code_interpreter", "content": "42\n"},
                                  {"role": "tool", "name": "search", "content": "none"}])
    text = ("<|start|>functions.code_interpreter to=assistant<|channel|>commentary<|message|>42\n<|end|>"
            "<|start|>functions.search to=assistant<|channel|>commentary<|message|>none<|end|><|start|>assistant")
    assert appended == tok(text, add_special_tokens=False)["input_ids"]
    assert sum(i in tok.convert_tokens_to_ids(HARMONY) for i in appended) == 9  # 4 a message, 1 the prompt
    assert tok.decode(template.appended([{"role": "user", "content": "Go on."}])) == \
        "<|start|>user<|message|>Go on.<|end|><|start|>assistant"


def test_an_episode_turn_keeps_its_special_tokens_and_its_call_runs(harmony_tokenizer, tiny_model_dir, tmp_path):
    """The loop decodes a gpt-oss turn with its special tokens (the call's markers), the tool agent reads the call
    from it and runs it, and the answer's tokens are harmony's; the tokenization check is not run (nothing to
    compare with)."""
    from transformers import AutoConfig

    from posttrain.agents.tool_agent import ToolAgent

    tok = harmony_tokenizer
    (tmp_path / "tools.py").write_text(
        "from posttrain.tools import function_tool\n\n\n@function_tool\ndef add(a: int, b: int) -> str:\n"
        '    """Add two numbers.\n\n    Args:\n        a: the first\n        b: the second\n    """\n'
        "    return str(a + b)\n")
    settings = AgentSettings(format="gpt-oss", function_tool_path=str(tmp_path / "tools.py"))
    call_id = tok.convert_tokens_to_ids("<|call|>")
    engine = SimpleNamespace(eos_ids={call_id}, model=SimpleNamespace(config=AutoConfig.from_pretrained(
        str(tiny_model_dir))))
    runner = EpisodeRunner(engine, tok, settings)
    runner._budget = 200  # (run() sets it from the sampling's max_new_tokens)
    ep = Episode(prompt_ids=[1, 2], messages=[{"role": "user", "content": "2 + 3?"}])
    turn = ('<|channel|>analysis<|message|>Use add.<|end|><|start|>assistant<|channel|>commentary to=functions.add '
            '<|constrain|>json<|message|>{"a": 2, "b": 3}')
    assert runner._end_turn(ep, tok(turn, add_special_tokens=False)["input_ids"] + [call_id], None)
    assert ep.messages[-1] == {"role": "assistant", "content": turn}
    agent = ToolAgent(settings)
    agent.reset({"prompt": [{"role": "user", "content": "2 + 3?"}]})
    step = agent.step(ep)
    assert [m["content"] for m in step.messages] == ["5"] and ep.tool_calls == 1
    appended = runner._answer(ep, step)
    assert tok.decode(appended) == ("<|start|>functions.add to=assistant<|channel|>commentary<|message|>5<|end|>"
                                    "<|start|>assistant")
    runner._finish(ep)
    assert ep.done and not ep.tokenization_mismatch


OK = ["data.train_batch_size=8", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
      "actor_rollout_ref.rollout.multi_turn.enable=True"]


def test_the_format_loads_with_its_note_and_not_with_an_agent_program(tmp_path):
    cfg = load_config(None, OK + ["actor_rollout_ref.rollout.multi_turn.format=gpt-oss"])
    assert "tokenization_sanity_check_mode=strict: no check with format=gpt-oss" in "\n".join(config_warnings(cfg))
    (tmp_path / "program.py").write_text("def play(row, base_url, api_key):\n    return 1.0\n")
    with pytest.raises(ConfigError, match="format=gpt-oss with actor_rollout_ref.rollout.agent.program"):
        load_config(None, OK + ["actor_rollout_ref.rollout.multi_turn.format=gpt-oss", "actor_rollout_ref.rollout.n=2",
                                f"actor_rollout_ref.rollout.agent.program={tmp_path / 'program.py'}:play"])
    with pytest.raises(ConfigError, match="format='llama3_json'"):
        load_config(None, OK + ["actor_rollout_ref.rollout.multi_turn.format=llama3_json"])
