"""Appended messages under the real chat templates of the families users train (tests/data/chat_templates/, their
sources in its README): Qwen2.5, Qwen3 (thinking on and off), Llama 3.1 and 3.2, DeepSeek-R1-Distill, Mistral-Nemo
and Gemma 2, each set as the tiny tokenizer's chat template (with the family's special tokens added).

What the tokens appended after an assistant turn must be: exactly what the template renders after that turn's
end-of-turn token in the whole conversation, up to and including the next generation prompt — the glue after the
end token, the new messages, the generation prompt — written out per family below from the templates themselves.
A template that cannot render the messages (Gemma has no `tool` role; Mistral-Nemo wants a `tool_call_id`) ends that
episode, counted; nothing crashes the step."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from posttrain.agents.environment import Reset, Step
from posttrain.agents.loop import EpisodeRunner
from posttrain.agents.settings import AgentSettings
from posttrain.agents.template import Template, TemplateError, render
from posttrain.rollout.base import SamplingParams
from posttrain.rollout.engine import DecodeEngine

TEMPLATES = Path(__file__).parent / "data" / "chat_templates"

QWEN = {"bos": None, "eos": "<|im_end|>", "ends": ["<|im_end|>"]}
LLAMA = {"bos": "<|begin_of_text|>", "eos": "<|eot_id|>", "ends": ["<|eot_id|>", "<|eom_id|>", "<|end_of_text|>"]}
FAMILIES = {  # name: (template file, template kwargs, bos, eos, the tokens that end a policy turn)
    "qwen2_5": ("qwen2_5", {}, QWEN),
    "qwen3_thinking": ("qwen3", {"enable_thinking": True}, QWEN),
    "qwen3_no_thinking": ("qwen3", {"enable_thinking": False}, QWEN),
    "llama3_1": ("llama3_1", {}, LLAMA),
    "llama3_2": ("llama3_2", {}, LLAMA),
    "deepseek_r1_distill": ("deepseek_r1_distill", {},
                            {"bos": "<｜begin▁of▁sentence｜>", "eos": "<｜end▁of▁sentence｜>",
                             "ends": ["<｜end▁of▁sentence｜>"]}),
    "mistral_nemo": ("mistral_nemo", {}, {"bos": "<s>", "eos": "</s>", "ends": ["</s>"]}),
    "gemma2": ("gemma2", {}, {"bos": "<bos>", "eos": "<eos>", "ends": ["<end_of_turn>", "<eos>"]}),
}
SPECIALS = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>",
            "<|end_of_text|>", "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>",
            "<｜tool▁outputs▁begin｜>", "<｜tool▁outputs▁end｜>", "<｜tool▁output▁begin｜>", "<｜tool▁output▁end｜>",
            "<s>", "</s>", "[INST]", "[/INST]", "<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>"]

QUESTION = [{"role": "user", "content": "What is 3 times 5?"}]
ANSWER = "I will use the calculator."
TOOL = [{"role": "tool", "content": "15"}]
TWO_TOOLS = [{"role": "tool", "content": "15"}, {"role": "tool", "content": "7"}]
USER = [{"role": "user", "content": "And 7?"}]

_QWEN_TOOL = "\n<|im_start|>user\n<tool_response>\n15\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
_QWEN_TWO = ("\n<|im_start|>user\n<tool_response>\n15\n</tool_response>\n<tool_response>\n7\n</tool_response>"
             "<|im_end|>\n<|im_start|>assistant\n")
_QWEN_USER = "\n<|im_start|>user\nAnd 7?<|im_end|>\n<|im_start|>assistant\n"
_NO_THINK = "<think>\n\n</think>\n\n"
_LLAMA_NEXT = "<|start_header_id|>assistant<|end_header_id|>\n\n"
_LLAMA = {  # a tool message is an ipython turn; its string content is written as JSON (the template's `iterable`)
    "tool": '<|start_header_id|>ipython<|end_header_id|>\n\n"15"<|eot_id|>' + _LLAMA_NEXT,
    "two_tools": ('<|start_header_id|>ipython<|end_header_id|>\n\n"15"<|eot_id|>'
                  '<|start_header_id|>ipython<|end_header_id|>\n\n"7"<|eot_id|>' + _LLAMA_NEXT),
    "user": "<|start_header_id|>user<|end_header_id|>\n\nAnd 7?<|eot_id|>" + _LLAMA_NEXT,
}
EXPECTED = {  # family -> case -> the appended text (None: the template refuses those messages)
    "qwen2_5": {"tool": _QWEN_TOOL, "two_tools": _QWEN_TWO, "user": _QWEN_USER},
    "qwen3_thinking": {"tool": _QWEN_TOOL, "two_tools": _QWEN_TWO, "user": _QWEN_USER},
    "qwen3_no_thinking": {"tool": _QWEN_TOOL + _NO_THINK, "two_tools": _QWEN_TWO + _NO_THINK,
                          "user": _QWEN_USER + _NO_THINK},
    "llama3_1": _LLAMA,
    "llama3_2": _LLAMA,
    "deepseek_r1_distill": {  # tool outputs get no generation prompt: the answer follows the outputs' end marker
        "tool": "<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>15<｜tool▁output▁end｜><｜tool▁outputs▁end｜>",
        "two_tools": ("<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>15<｜tool▁output▁end｜>\n"
                      "<｜tool▁output▁begin｜>7<｜tool▁output▁end｜><｜tool▁outputs▁end｜>"),
        "user": "<｜User｜>And 7?<｜Assistant｜><think>\n"},
    "mistral_nemo": {"tool": None, "two_tools": None, "user": "[INST]And 7?[/INST]"},
    "gemma2": {"tool": None, "two_tools": None,
               "user": "\n<start_of_turn>user\nAnd 7?<end_of_turn>\n<start_of_turn>model\n"},
}
CASES = {"tool": TOOL, "two_tools": TWO_TOOLS, "user": USER}


@pytest.fixture(scope="module")
def specials_tokenizer(tiny_tokenizer):
    """The tiny tokenizer with every family's special tokens added."""
    tok = copy.deepcopy(tiny_tokenizer)
    tok.add_special_tokens({"additional_special_tokens": SPECIALS})
    return tok


def family(specials_tokenizer, name: str):
    """(tokenizer with the family's template, bos and eos; template kwargs; ids of the tokens that end a turn)."""
    file, kwargs, tokens = FAMILIES[name]
    tok = copy.deepcopy(specials_tokenizer)
    tok.chat_template = (TEMPLATES / f"{file}.jinja").read_text()
    tok.bos_token, tok.eos_token = tokens["bos"], tokens["eos"]
    return tok, kwargs, {tok.convert_tokens_to_ids(t) for t in tokens["ends"]}


def text(tok, messages, kwargs, *, generation: bool) -> str:
    return tok.apply_chat_template(messages, add_generation_prompt=generation, tokenize=False, **kwargs)


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_appended_tokens_are_what_the_family_s_template_renders_after_the_turn(specials_tokenizer, name, case):
    tok, kwargs, ends = family(specials_tokenizer, name)
    template = Template(tok, ends, kwargs)
    want = EXPECTED[name][case]
    if want is None:
        with pytest.raises(TemplateError, match="cannot render"):
            template.appended(CASES[case])
        return
    got = template.appended(CASES[case])
    assert tok.decode(got, skip_special_tokens=False) == want
    # and token for token what the whole conversation's rendering holds after the assistant's end token
    whole = render(tok, QUESTION + [{"role": "assistant", "content": ANSWER}] + CASES[case], None,
                   add_generation_prompt=True, **kwargs)
    assert whole[-len(got):] == got
    assert whole[-len(got) - 1] in ends
    assert tok.decode(whole[:-len(got) - 1]).endswith(ANSWER)


@pytest.mark.parametrize("name", ["qwen2_5", "llama3_1", "llama3_2", "mistral_nemo", "gemma2"])
def test_an_episode_s_kept_ids_are_the_whole_conversation_rendered_where_the_template_renders_turns_alike(
        specials_tokenizer, name):
    """The prompt, the policy's turn (its own tokens and end token), the appended user message: the template's
    rendering of the whole conversation. (Qwen3 renders the last assistant turn with an empty think block and
    DeepSeek drops the think opener of past turns, so theirs differ from a re-render by design: the appended part is
    held to the test above.)"""
    tok, kwargs, ends = family(specials_tokenizer, name)
    template = Template(tok, ends, kwargs)
    end = next(t for t in ends if tok.convert_ids_to_tokens(t) == FAMILIES[name][2]["ends"][0])
    kept = (render(tok, QUESTION, None, add_generation_prompt=True, **kwargs)
            + tok(ANSWER, add_special_tokens=False)["input_ids"] + [end] + template.appended(USER))
    whole = render(tok, QUESTION + [{"role": "assistant", "content": ANSWER}] + USER, None,
                   add_generation_prompt=True, **kwargs)
    assert kept == whole


class ToolThenUser:
    """A tool result, then a user message, then done."""

    def reset(self, row):
        self.seen = 0
        return Reset(messages=list(QUESTION))

    def step(self, episode):
        self.seen += 1
        return Step(done=True) if self.seen > 2 else Step(messages=TOOL if self.seen == 1 else USER, reward=0.5)

    def close(self):
        pass


@pytest.fixture(scope="module")
def wide_lm(lm, specials_tokenizer):
    """The tiny model with embedding rows for the added special tokens."""
    model = copy.deepcopy(lm)
    model.resize_token_embeddings(len(specials_tokenizer), mean_resizing=False)
    return model


@pytest.mark.parametrize("name, continuous", [(name, True) for name in sorted(FAMILIES)]
                         + [("qwen3_thinking", False), ("gemma2", False)])
def test_episodes_run_under_every_family_s_template_and_a_refused_message_ends_only_its_episode(
        specials_tokenizer, wide_lm, name, continuous):
    """Multi-turn episodes through EpisodeRunner (the continuous loop; the turn-by-turn one for two families) under
    each template: no crash; where the template
    refuses a tool message the episode ends there, counted as `template_error`; elsewhere the policy goes on after
    the tool result and after the user message, and every appended span is the template's rendering of its
    messages."""
    tok, kwargs, ends = family(specials_tokenizer, name)
    engine = DecodeEngine(wide_lm, tok, device=torch.device("cpu"), dtype=torch.float32)
    runner = EpisodeRunner(engine, tok, AgentSettings(tokenization_sanity_check_mode="disable",
                                                      template_kwargs=kwargs),
                           environments=lambda row: ToolThenUser())
    runner.template = Template(tok, ends, kwargs)
    engine.eos_ids = {t for t in range(len(tok)) if t % 5 == 0} | ends  # turns end within a few tokens
    episodes = runner.run([{"uid": "p0"}], 2, SamplingParams(n=2, do_sample=False, max_new_tokens=120),
                          continuous=continuous)
    refuses = EXPECTED[name]["tool"] is None
    for ep in episodes:
        assert ep.done
        if refuses:
            assert ep.tool_errors == {"template_error": 1} and ep.assistant_turns == 1
            continue
        assert not ep.tool_errors
        spans = [ep.tokens[i:j] for i, j in _appended_spans(ep.mask)]
        want = [EXPECTED[name]["tool"], EXPECTED[name]["user"]]
        assert [tok.decode(s, skip_special_tokens=False) for s in spans] == want[:len(spans)]
        assert ep.truncated or ep.assistant_turns == 3


def _appended_spans(mask: list[int]) -> list[tuple[int, int]]:
    spans, i = [], 0
    while i < len(mask):
        j = i
        while j < len(mask) and mask[j] == mask[i]:
            j += 1
        if mask[i] == 0:
            spans.append((i, j))
        i = j
    return spans


def test_a_template_that_cannot_render_a_conversation_at_all_is_refused_when_the_runner_is_built(tiny_tokenizer,
                                                                                                    lm):
    tok = copy.deepcopy(tiny_tokenizer)
    tok.chat_template = "{{ raise_exception('This template wants a system message first') }}"
    engine = DecodeEngine(lm, tok, device=torch.device("cpu"), dtype=torch.float32)
    with pytest.raises(TemplateError, match="wants a system message first"):
        EpisodeRunner(engine, tok, AgentSettings())
