"""Every request field of `posttrain serve` acts: the logits processing (posttrain/serve/processors.py) against
float64 re-derivations by plain loops, each field through the real `openai` client where it is a client field,
structured output (llguidance) parsed and checked against its schema, and a walk over every field of ChatRequest and
CompletionRequest: each changes the answer for a non-default value or is refused with a 400 naming it (FIELDS; a
field added to the models without an entry there fails the walk). vLLM's fields that posttrain does not implement are
refused by name; fields neither API knows are ignored with a warning in the log."""

from __future__ import annotations

import copy
import json
import logging
import math
import re
import uuid

import pytest
import torch

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

from posttrain.serve import structured  # noqa: E402
from posttrain.serve.app import Served, build_app  # noqa: E402
from posttrain.serve.fields import VLLM_UNSUPPORTED  # noqa: E402
from posttrain.serve.processors import Processing, adjust  # noqa: E402
from posttrain.serve.protocol import ChatRequest, CompletionRequest  # noqa: E402
from posttrain.serve.recorder import Recorder  # noqa: E402
from posttrain.serve.scheduler import Event, Scheduler  # noqa: E402
from posttrain.serve.server import serve_in_thread  # noqa: E402

MODEL = "tiny"
USER = [{"role": "user", "content": "12*34="}]
IM_START = 1  # the tiny tokenizer's <|im_start|>: special, never a stop
grammar = pytest.mark.skipif(not structured.available(), reason="structured output needs llguidance")


# ---------------------------------------------------------------------------------------------- the processing

def loops_penalised(logits: list[float], prompt: list[int], out: list[int], rep: float, freq: float,
                    pres: float) -> list[float]:
    """The penalties by their definitions, one token at a time in float64: CTRL's repetition penalty over prompt +
    output (divide a positive logit, multiply a negative one), then OpenAI's frequency and presence penalties over
    the output."""
    result = []
    for token, value in enumerate(logits):
        if token in prompt or token in out:
            value = value / rep if value > 0 else value * rep
        count = out.count(token)
        result.append(value - freq * count - (pres if count else 0.0))
    return result


def state(processing: Processing, prompt, out, stops=(0,), temperature=1.0, greedy=False):
    s = processing.start(list(prompt), set(stops), temperature, greedy)
    for t in out:
        s.advance(t)
    return s


def test_penalties_are_the_formulas_computed_in_float64_by_plain_loops():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 40, generator=g) * 3
    rows = [(Processing(repetition_penalty=1.7), [3, 4, 5], [7, 7, 9]),
            (Processing(frequency_penalty=0.6, presence_penalty=-0.4), [3], [7, 7, 9, 7, 11]),
            (Processing(repetition_penalty=0.8, frequency_penalty=-1.1, presence_penalty=1.3), [1, 2, 2], [2, 5, 5])]
    got = adjust(logits, [state(p, prompt, out) for p, prompt, out in rows])
    for i, (p, prompt, out) in enumerate(rows):
        want = loops_penalised(logits[i].double().tolist(), prompt, out, p.repetition_penalty, p.frequency_penalty,
                               p.presence_penalty)
        assert got[i].tolist() == pytest.approx(want, abs=1e-5)
    assert torch.equal(logits, torch.randn(3, 40, generator=torch.Generator().manual_seed(0)) * 3)  # left as it was


def test_masks_bias_min_tokens_and_min_p_in_vllms_order():
    logits = torch.randn(1, 30, generator=torch.Generator().manual_seed(1)) * 2
    allowed = tuple(range(2, 25))
    p = Processing(allowed_token_ids=allowed, bad_words=((5,), (7, 8), (9, 10)), min_tokens=4,
                   logit_bias=((4, 2.5), (11, -100.0), (12, 1.0)), min_p=0.05)
    s = state(p, [1], [6, 7], stops=(3, 13), temperature=0.7)
    want = logits[0].double().tolist()
    for t in range(30):
        if t not in allowed or t in (5, 8) or t in (3, 13):  # 8 follows the 7 just sampled; 10 does not follow 9
            want[t] = -math.inf
    for t, b in ((4, 2.5), (11, -100.0), (12, 1.0)):
        want[t] += b
    top = max(want)  # min_p at temperature 0.7: less likely than 0.05 x the likeliest goes
    probs = [math.exp((v - top) / 0.7) for v in want]
    want = [v if q >= 0.05 else -math.inf for v, q in zip(want, probs)]
    got = adjust(logits, [s])[0].tolist()
    assert [math.isinf(v) for v in got] == [math.isinf(v) for v in want]
    assert [v for v in got if math.isfinite(v)] == pytest.approx([v for v in want if math.isfinite(v)], abs=1e-5)
    # greedy rows skip min_p (it never changes the argmax); after min_tokens the stop tokens come back
    s = state(p, [1], [6, 7, 6, 6], stops=(3, 13), greedy=True, temperature=0.7)
    got = adjust(logits, [s])[0]
    assert torch.isfinite(got[3]) and torch.isfinite(got[13]) and int(torch.isfinite(got).sum()) > 5


def test_a_row_left_with_no_token_may_end():
    s = state(Processing(allowed_token_ids=(3,), min_tokens=5), [1], [], stops=(3, 13))
    got = adjust(torch.zeros(1, 20), [s])[0]
    assert sorted(torch.isfinite(got).nonzero().flatten().tolist()) == [3, 13]


# ---------------------------------------------------------------------------------------------- the server

@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """The tool task's tiny model behind the app (with a recorder: the exact ids of every answer), its reference
    copy, and a second app whose template reads a `suffix_word` keyword (for chat_template_kwargs)."""
    from posttrain.data.synthetic_tools import tokenizer_corpus
    from posttrain.models.load import load_causal_lm, load_tokenizer
    from posttrain.models.policy import PolicyModel
    from posttrain.models.tiny import build_tiny_model
    from posttrain.rollout.registry import build_engine

    path = str(build_tiny_model(tmp_path_factory.mktemp("fields"), tokenizer_corpus(0, 300), hidden_size=64,
                                num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128, seed=0, tools=True))
    tokenizer = load_tokenizer(path)
    engine = build_engine("posttrain", PolicyModel(load_causal_lm(path)), tokenizer, device=torch.device("cpu"),
                          dtype=torch.float32)
    scheduler = Scheduler(engine, max_running=16, max_waiting=32)
    scheduler.start()
    recorder = Recorder()
    keyed = copy.deepcopy(tokenizer)
    keyed.chat_template += "{%- if suffix_word %}{{- suffix_word }}{%- endif %}"
    with serve_in_thread(build_app(Served(MODEL, tokenizer, scheduler), recorder=recorder)) as server, \
            serve_in_thread(build_app(Served(MODEL, keyed, scheduler), recorder=recorder)) as keyed_server:
        ctx = Ctx(tokenizer, load_causal_lm(path).eval(), engine, recorder, server.base_url, keyed_server.base_url)
        yield ctx
        ctx.http.close()
    scheduler.close()


class Answer:
    """One answer: its status and body, and from the recorder each choice's prompt and sampled ids and their
    recorded log-probs (those of the processed distribution each token was drawn from)."""

    def __init__(self, response: httpx.Response, calls: list):
        self.status, self.response = response.status_code, response
        self.ids, self.prompts = [c.completion_ids for c in calls], [c.prompt_ids for c in calls]
        self.recorded = [c.logprobs for c in calls]
        self.json = response.json() if "json" in response.headers.get("content-type", "") else None

    @property
    def choices(self) -> list[dict]:
        return self.json["choices"]

    def text(self, i: int = 0) -> str:
        c = self.choices[i]
        return c["text"] if "text" in c else (c["message"]["content"] or "")

    def logprobs(self, i: int = 0) -> list[float]:
        lp = self.choices[i]["logprobs"]
        return [e["logprob"] for e in lp["content"]] if "content" in lp else lp["token_logprobs"]

    def refused(self, param: str) -> bool:
        return self.status == 400 and self.json["error"]["param"] == param


class Ctx:
    """Requests against the served app, each answered with its exact ids (from the recorder)."""
    BASE = {"chat": dict(model=MODEL, messages=USER, max_tokens=6, temperature=1.0, seed=5, logprobs=True),
            "completion": dict(model=MODEL, prompt="12*34=", max_tokens=6, temperature=1.0, seed=5, logprobs=0)}

    def __init__(self, tokenizer, lm, engine, recorder, url, keyed_url):
        self.tokenizer, self.lm, self.engine, self.recorder, self.url, self.keyed_url = (
            tokenizer, lm, engine, recorder, url, keyed_url)
        self.eos, self.one = min(engine.eos_ids), tokenizer.convert_tokens_to_ids("1")
        self.caplog = None
        self.http = httpx.Client(timeout=120)  # one kept-alive connection for the many small requests
        self._base = {}

    def post(self, kind: str, url: str | None = None, **fields) -> Answer:
        """`fields` over the plain request (`...`: a field left out; in logit_bias and stop_token_ids, "EOS" and
        "ONE" stand for the EOS token and the token of "1")."""
        body = {k: v for k, v in {**self.BASE[kind], **fields}.items() if v is not ...}
        named = {"EOS": self.eos, "ONE": self.one}
        if isinstance(body.get("logit_bias"), dict):
            body["logit_bias"] = {str(named.get(t, t)): b for t, b in body["logit_bias"].items()}
        if isinstance(body.get("stop_token_ids"), list):
            body["stop_token_ids"] = [named.get(t, t) for t in body["stop_token_ids"]]
        episode = uuid.uuid4().hex
        route = "/chat/completions" if kind == "chat" else "/completions"
        r = self.http.post((url or self.url) + route, json=body, headers={"X-Episode-Id": episode})
        calls = self.recorder.take(episode)[0] if r.status_code == 200 and not body.get("stream") else []
        return Answer(r, calls)

    def base(self, kind: str) -> Answer:
        if kind not in self._base:
            self._base[kind] = self.post(kind)
        return self._base[kind]

    def client(self) -> "openai.OpenAI":
        return openai.OpenAI(base_url=self.url, api_key="fields", max_retries=0)

    def reference(self, prompt: list[int], steps: int, process=lambda logits, out: logits) -> list[int]:
        """Greedy decoding by the model's own forward over the whole sequence (no cache), the logits processed
        by `process(float64 list, tokens so far)`; stops after an EOS."""
        ids, out = list(prompt), []
        with torch.no_grad():
            for _ in range(steps):
                logits = process(self.lm(torch.tensor([ids])).logits[0, -1].double().tolist(), out)
                t = max(range(len(logits)), key=logits.__getitem__)
                out.append(t)
                ids.append(t)
                if t in self.engine.eos_ids:
                    break
        return out

    def prompt_logprobs(self, prompt: list[int]) -> list[float]:
        with torch.no_grad():
            table = torch.log_softmax(self.lm(torch.tensor([prompt])).logits[0].double(), dim=-1)
        return [table[k - 1, prompt[k]].item() for k in range(1, len(prompt))]


def test_penalties_change_greedy_decoding_as_the_formulas_say(served):
    a = served.post("chat", temperature=0, max_tokens=10, repetition_penalty=1.3, frequency_penalty=0.5,
                    presence_penalty=0.4)
    prompt = a.prompts[0]
    want = served.reference(prompt, 10, lambda x, out: loops_penalised(x, prompt, out, 1.3, 0.5, 0.4))
    assert a.ids[0] == want and want != served.reference(prompt, 10)
    r = served.client().chat.completions.create(model=MODEL, messages=USER, max_tokens=10, temperature=0,
                                                presence_penalty=0.4, frequency_penalty=0.5,
                                                extra_body={"repetition_penalty": 1.3})
    assert r.choices[0].message.content == served.tokenizer.decode(want, skip_special_tokens=True)


def test_logit_bias_forces_and_bans_tokens(served):
    plain = served.post("chat", temperature=0)
    forced = served.post("chat", temperature=0, logit_bias={"50": 100})
    assert forced.ids[0] == [50] * 6
    banned = served.post("chat", temperature=0, logit_bias={str(plain.ids[0][0]): -100})
    assert banned.ids[0][0] != plain.ids[0][0]
    assert served.post("chat", logit_bias={"50": 101}).refused("logit_bias")
    assert served.post("chat", logit_bias={"100000": 1}).refused("logit_bias")
    assert served.post("chat", logit_bias={"x": 1}).refused("logit_bias")


def test_min_tokens_holds_back_eos_and_stop_ids_and_ignore_eos_goes_past_eos(served):
    eos_first = {str(served.eos): 100}
    assert served.post("chat", logit_bias=eos_first).ids[0] == [served.eos]
    held = served.post("chat", logit_bias=eos_first, min_tokens=4, stop_token_ids=[60], max_tokens=9)
    assert len(held.ids[0]) == 5 and held.ids[0][-1] == served.eos
    assert not set(held.ids[0][:4]) & ({served.eos, 60} | set(served.engine.eos_ids))
    plain = served.post("chat", temperature=0, max_tokens=8)
    stop_at = plain.ids[0][3]
    stopped = served.post("chat", temperature=0, max_tokens=8, stop_token_ids=[stop_at])
    assert stopped.ids[0] == plain.ids[0][:plain.ids[0].index(stop_at) + 1]
    assert stopped.choices[0]["finish_reason"] == "stop"
    past = served.post("chat", logit_bias=eos_first, ignore_eos=True, max_tokens=4)
    assert past.ids[0] == [served.eos] * 4 and past.choices[0]["finish_reason"] == "length"
    assert served.post("chat", min_tokens=7, max_tokens=6).refused("min_tokens")


def test_stop_strings_and_include_stop_str_in_output(served):
    same = dict(max_tokens=16, temperature=1.0, seed=3)
    text = served.post("chat", **same).text()
    k = next(k for k in range(1, len(text) - 1) if text.find(text[k:k + 2]) == k)  # a stop string first seen at k
    stop = text[k:k + 2]
    c = served.client()
    cut = c.chat.completions.create(model=MODEL, messages=USER, stop=[stop], **same)
    kept = c.chat.completions.create(model=MODEL, messages=USER, stop=[stop], **same,
                                     extra_body={"include_stop_str_in_output": True})
    assert cut.choices[0].message.content == text[:k] and kept.choices[0].message.content == text[:k + 2]
    assert cut.choices[0].finish_reason == kept.choices[0].finish_reason == "stop"
    streamed = c.completions.create(model=MODEL, prompt="12*34=", stream=True, stop=[stop], **same,
                                    extra_body={"include_stop_str_in_output": True})
    whole = served.post("completion", stop=[stop], include_stop_str_in_output=True, **same)
    assert "".join(ch.choices[0].text for ch in streamed) == whole.text()
    assert stop not in whole.text()[:-len(stop)] and (whole.text().endswith(stop) or len(whole.ids[0]) == 16)


def test_a_stop_token_that_ends_a_sample_gives_no_text_unless_asked(served):
    """As vLLM: the token of `stop_token_ids` (or EOS) a sample ends on is in its ids, not in its text, streamed or
    whole, unless `include_stop_str_in_output`."""
    plain = served.post("chat", temperature=0, max_tokens=8)
    stop_at = plain.ids[0][3]
    cut = plain.ids[0][:plain.ids[0].index(stop_at) + 1]
    text = lambda ids: served.tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
    assert text(cut[-1:]), "the test needs a stop token with text of its own"
    whole = served.post("chat", temperature=0, max_tokens=8, stop_token_ids=[stop_at])
    assert whole.ids[0] == cut and whole.text() == text(cut[:-1])
    kept = served.post("chat", temperature=0, max_tokens=8, stop_token_ids=[stop_at], include_stop_str_in_output=True)
    assert kept.text() == text(cut)
    streamed = served.client().chat.completions.create(model=MODEL, messages=USER, max_tokens=8, temperature=0,
                                                       stream=True, extra_body={"stop_token_ids": [stop_at]})
    assert "".join(ch.choices[0].delta.content or "" for ch in streamed if ch.choices) == text(cut[:-1])


def test_skip_special_tokens_false_keeps_their_text(served):
    special = {str(IM_START): 100}
    assert served.post("chat", logit_bias=special, max_tokens=2).text() == ""
    assert served.post("chat", logit_bias=special, max_tokens=2, skip_special_tokens=False).text() == \
        "<|im_start|>" * 2


def test_bad_words_and_allowed_token_ids(served):
    same = dict(max_tokens=12, temperature=1.0, seed=4)
    plain = served.post("chat", **same).ids[0]
    tok = served.tokenizer
    at, word = next((i, tok.decode([t]).strip()) for i, t in enumerate(plain)
                    if tok.decode([t]).strip() and tok.encode(tok.decode([t]).strip(), add_special_tokens=False) == [t])
    banned = served.post("chat", bad_words=[word], **same).ids[0]
    assert banned[:at] == plain[:at] and plain[at] not in banned  # a one-token word never comes
    two = served.post("chat", bad_words=[tok.decode(plain[at:at + 2])], **same).ids[0]  # a two-token word
    assert two[:at + 1] == plain[:at + 1] and two[at + 1] != plain[at + 1]
    allowed = [40, 41, 42, served.eos]
    few = served.post("chat", n=3, max_tokens=8, allowed_token_ids=allowed)
    assert all(set(ids) <= set(allowed) for ids in few.ids) and len(few.ids) == 3
    assert served.post("chat", allowed_token_ids=[]).refused("allowed_token_ids")
    assert served.post("chat", stop_token_ids=[10**6]).refused("stop_token_ids")


def test_min_p_of_one_leaves_only_the_likeliest_token(served):
    greedy = served.post("chat", temperature=0, max_tokens=8)
    only = served.post("chat", temperature=1.0, seed=11, max_tokens=8, min_p=1.0)
    assert only.ids[0] == greedy.ids[0] and only.recorded[0] == [0.0] * len(only.ids[0])


def test_top_logprobs_are_sorted_and_hold_the_sampled_token(served):
    r = served.client().chat.completions.create(model=MODEL, messages=USER, max_tokens=6, temperature=0,
                                                logprobs=True, top_logprobs=5)
    a = served.post("chat", temperature=0, max_tokens=6)
    prompt, ids = a.prompts[0], a.ids[0]
    for k, entry in enumerate(r.choices[0].logprobs.content):
        top = entry.top_logprobs
        values = [t.logprob for t in top]
        assert len(top) == 5 and values == sorted(values, reverse=True) and sum(map(math.exp, values)) <= 1 + 1e-5
        assert top[0].token == entry.token and top[0].logprob == entry.logprob  # greedy: the sampled one leads
        with torch.no_grad():
            table = torch.log_softmax(served.lm(torch.tensor([prompt + ids[:k]])).logits[0, -1].double(), dim=-1)
        assert values == pytest.approx(table.topk(5).values.tolist(), abs=1e-4)
    sampled = served.post("chat", n=2, top_logprobs=3)  # sampled at temperature 1: each token's own log-prob
    for i in range(2):
        for entry in sampled.choices[i]["logprobs"]["content"]:
            tops = {t["token"]: t["logprob"] for t in entry["top_logprobs"]}
            assert len(tops) <= 3 and (entry["token"] not in tops or tops[entry["token"]] == entry["logprob"])
            assert entry["logprob"] <= max(tops.values()) + 1e-6


def test_completion_logprobs_and_echo_give_the_prompts_log_probs(served):
    prompt = served.tokenizer("12*34=")["input_ids"]
    r = served.client().completions.create(model=MODEL, prompt=prompt, max_tokens=3, temperature=0, echo=True,
                                           logprobs=2)
    lp = r.choices[0].logprobs
    prompt_text = served.tokenizer.decode(prompt, skip_special_tokens=False)
    assert r.choices[0].text.startswith(prompt_text) and lp.token_logprobs[0] is None
    assert lp.token_logprobs[1:len(prompt)] == pytest.approx(served.prompt_logprobs(prompt), abs=1e-4)
    assert lp.top_logprobs[0] is None and all(0 < len(t) <= 3 for t in lp.top_logprobs[1:])
    for token, value, top in zip(lp.tokens[1:], lp.token_logprobs[1:], lp.top_logprobs[1:]):
        assert top[token] == value and value <= max(top.values())
    assert len(lp.tokens) == len(prompt) + 3 and lp.text_offset[len(prompt)] == len(prompt_text)
    plain = served.post("completion", prompt=prompt, max_tokens=3, temperature=0, logprobs=None)
    echoed = served.post("completion", prompt=prompt, max_tokens=3, temperature=0, logprobs=None, echo=True)
    assert echoed.text() == prompt_text + plain.text() and echoed.choices[0]["logprobs"] is None
    streamed = served.client().completions.create(model=MODEL, prompt=prompt, max_tokens=3, temperature=0, echo=True,
                                                  logprobs=2, stream=True)
    chunks = list(streamed)
    assert "".join(c.choices[0].text for c in chunks) == r.choices[0].text
    assert [t for c in chunks for t in c.choices[0].logprobs.token_logprobs] == lp.token_logprobs


PERSON = {"type": "object", "properties": {"age": {"type": "integer", "minimum": 0, "maximum": 99},
                                           "pet": {"enum": ["cat", "dog"]}, "ok": {"type": "boolean"}},
          "required": ["age", "pet", "ok"], "additionalProperties": False}


def valid_person(value) -> bool:
    return (isinstance(value, dict) and set(value) == {"age", "pet", "ok"} and type(value["age"]) is int
            and 0 <= value["age"] <= 99 and value["pet"] in ("cat", "dog") and isinstance(value["ok"], bool))


@grammar
def test_json_schema_and_json_object_outputs_parse_and_validate(served):
    c = served.client()
    for seed in (1, 2):
        r = c.chat.completions.create(model=MODEL, messages=USER, max_tokens=120, seed=seed,
                                      response_format={"type": "json_schema",
                                                       "json_schema": {"name": "person", "schema": PERSON}})
        assert r.choices[0].finish_reason == "stop" and valid_person(json.loads(r.choices[0].message.content))
        r = c.completions.create(model=MODEL, prompt="{", max_tokens=120, seed=seed,
                                 extra_body={"guided_json": PERSON, "structured_outputs": None})
        assert valid_person(json.loads(r.choices[0].text))
    r = c.chat.completions.create(model=MODEL, messages=USER, max_tokens=150, seed=4,
                                  response_format={"type": "json_object"})
    assert r.choices[0].finish_reason != "stop" or isinstance(json.loads(r.choices[0].message.content), dict)
    assert r.choices[0].message.content.lstrip().startswith("{")


@grammar
def test_regex_choice_and_grammar_constraints(served):
    for seed in (1, 2):
        assert re.fullmatch(r"[ab]{2,4}!", served.post("chat", seed=seed, max_tokens=20,
                                                       guided_regex=r"[ab]{2,4}!").text())
        assert served.post("completion", seed=seed, guided_choice=["yes", "no", "maybe so"]).text() in (
            "yes", "no", "maybe so")
        assert served.post("chat", seed=seed, structured_outputs={"choice": ["up", "down"]}).text() in ("up", "down")
        assert served.post("chat", seed=seed, max_tokens=10,
                           guided_grammar='start: "x" num\nnum: /[0-9]/').text() in [f"x{d}" for d in range(10)]
    assert served.post("chat", guided_regex="(").refused("guided_regex")
    assert served.post("chat", guided_regex="a", guided_choice=["a"]).refused("guided_choice")
    assert served.post("chat", response_format={"type": "json_schema", "json_schema": {"name": "x"}}).refused(
        "response_format")
    assert served.post("chat", structured_outputs={"whitespace_pattern": " "}).refused("structured_outputs")


def calculator_tools():
    from posttrain.data.synthetic_tools import tool_schemas

    other = {"type": "function", "function": {"name": "lookup", "description": "find a word", "parameters": {
        "type": "object", "properties": {"word": {"type": "string", "maxLength": 6}}, "required": ["word"],
        "additionalProperties": False}}}
    tools = tool_schemas()  # bounded, so that the untrained model's calls end within max_tokens
    tools[0]["function"]["parameters"]["properties"]["expression"]["maxLength"] = 8
    tools[0]["function"]["parameters"]["additionalProperties"] = False
    return tools + [other]


@grammar
def test_tool_choice_required_or_named_returns_calls_of_the_tools(served):
    c, tools = served.client(), calculator_tools()
    for seed in (1, 2):
        r = c.chat.completions.create(model=MODEL, messages=USER, tools=tools, tool_choice="required", seed=seed,
                                      max_tokens=120)
        calls = r.choices[0].message.tool_calls
        assert r.choices[0].finish_reason == "tool_calls" and calls, repr(r.choices[0].message.content)
        for call in calls:
            args = json.loads(call.function.arguments)
            assert (call.function.name, set(args)) in (("calculator", {"expression"}), ("lookup", {"word"}))
        r = c.chat.completions.create(model=MODEL, messages=USER, tools=tools, seed=seed, max_tokens=120,
                                      tool_choice={"type": "function", "function": {"name": "lookup"}})
        (call,) = r.choices[0].message.tool_calls
        assert call.function.name == "lookup" and isinstance(json.loads(call.function.arguments)["word"], str)
        chunks = list(c.chat.completions.create(model=MODEL, messages=USER, tools=tools, tool_choice="required",
                                                seed=seed, max_tokens=120, stream=True))
        assert any(d.function.name for ch in chunks for d in ch.choices[0].delta.tool_calls or [])
    assert served.post("chat", tools=tools, tool_choice={"type": "function", "function": {"name": "nope"}}).refused(
        "tool_choice")
    assert served.post("chat", tool_choice="required").refused("tool_choice")  # no tools


def test_parallel_tool_calls_false_returns_the_first_call_only(served):
    from posttrain.data.synthetic_tools import tool_schemas

    tokenizer = served.tokenizer
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "1+1"}}</tool_call>'
    ids = tokenizer(call + "\n" + call.replace("1+1", "2+2"))["input_ids"] + [served.eos]

    class Fixed:
        context_length, vocab_size = 512, len(tokenizer)

        def submit(self, prompt_ids, n, sampling):
            return Events([Event(s, t, -0.5) for s in range(n) for t in ids] + [Event(s, None, None, "stop")
                                                                                  for s in range(n)])

    with serve_in_thread(build_app(Served(MODEL, tokenizer, Fixed()))) as server:
        c = openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0)
        both = c.chat.completions.create(model=MODEL, messages=USER, tools=tool_schemas())
        one = c.chat.completions.create(model=MODEL, messages=USER, tools=tool_schemas(), parallel_tool_calls=False)
        assert len(both.choices[0].message.tool_calls) == 2 and len(one.choices[0].message.tool_calls) == 1
        assert json.loads(one.choices[0].message.tool_calls[0].function.arguments) == {"expression": "1+1"}


class Events:
    def __init__(self, events):
        self._events = events
        self.prompt_logprobs = None

    def take(self):
        events, self._events = self._events, []
        return events

    def notify(self, loop, callback, final=False):
        return not self._events

    def cancel(self, sample=None):
        pass


def test_chat_template_kwargs_reach_the_template(served):
    plain = served.post("chat", url=served.keyed_url)
    keyed = served.post("chat", url=served.keyed_url, chat_template_kwargs={"suffix_word": " bonus"})
    assert keyed.prompts[0][:len(plain.prompts[0])] == plain.prompts[0] and len(keyed.prompts[0]) > len(
        plain.prompts[0])


def test_identity_fields_name_the_answer_and_the_log(served, caplog):
    with caplog.at_level(logging.INFO, logger="posttrain.serve.fields"):
        a = served.post("chat", request_id="abc123", user="someone", session_id="conversation-9")
    assert a.json["id"] == "chatcmpl-abc123" and served.post("completion", request_id="q").json["id"] == "cmpl-q"
    assert any("someone" in r.getMessage() and "conversation-9" in r.getMessage() for r in caplog.records)


def test_vllm_fields_not_implemented_are_refused_and_unknown_fields_warned(served, caplog):
    for kind, table in (("chat", VLLM_UNSUPPORTED["chat"]), ("completion", VLLM_UNSUPPORTED["completion"])):
        for name in table:
            assert served.post(kind, **{name: "something else"}).refused(name), (kind, name)
        assert served.post(kind, use_beam_search=False, priority=0, cache_salt=None).status == 200
    with caplog.at_level(logging.WARNING, logger="posttrain.serve.fields"):
        assert served.post("chat", no_such_field=1, store=True).status == 200
    assert any("no_such_field" in r.getMessage() and "store" in r.getMessage() for r in caplog.records)
    e = pytest.raises(openai.BadRequestError, served.client().chat.completions.create, model=MODEL, messages=USER,
                      extra_body={"use_beam_search": True}).value
    assert e.body["param"] == "use_beam_search" and "use_beam_search" in e.message


def test_structured_output_without_the_library_is_refused_by_name(served, monkeypatch):
    monkeypatch.setattr(structured, "_library", lambda: None)
    a = served.post("chat", response_format={"type": "json_object"})
    assert a.refused("response_format") and "posttrain[structured]" in a.json["error"]["message"]
    assert served.post("chat", tools=calculator_tools(), tool_choice="required").refused("tool_choice")


def test_rollout_keys_for_such_processing_are_refused_at_load():
    """verl's rollout config has `repetition_penalty` (its agent loop sends 1.0 whatever it says); posttrain's
    rollouts sample with temperature / top-k / top-p only, so the key is refused when the config loads, by name."""
    from posttrain.config.loader import load_config
    from posttrain.errors import ConfigError

    for key in ("repetition_penalty", "presence_penalty", "min_p", "val_kwargs.repetition_penalty"):
        with pytest.raises(ConfigError, match=re.escape(f"actor_rollout_ref.rollout.{key}")):
            load_config(None, [f"actor_rollout_ref.rollout.{key}=1.2"], validate=False)


# ---------------------------------------------------------------------------------------------- the walk

def differs(field_value: dict, kind: str = "both"):
    """Check: the recorded log-probs (of the distribution each token was drawn from) differ from the plain
    request's."""
    def check(ctx, k):
        a = ctx.post(k, **field_value)
        assert a.status == 200 and a.recorded != ctx.base(k).recorded, a.response.text
    return check


def holds(fields: dict, predicate):
    def check(ctx, k):
        a = ctx.post(k, **fields)
        assert a.status == 200 and predicate(ctx, a, k), a.response.text
    return check


def refused(fields: dict, param: str):
    def check(ctx, k):
        a = ctx.post(k, **fields)
        assert a.refused(param) or (param == "model" and a.status == 404 and a.json["error"]["param"] == "model")
    return check


def constrained(fields: dict, allowed: set[str], param: str):
    def check(ctx, k):
        a = ctx.post(k, max_tokens=12, **fields)
        if structured.available():
            assert a.status == 200 and a.text() in allowed, a.response.text
        else:
            assert a.refused(param)
    return check


def streamed_usage(ctx, k):
    with_usage = ctx.post(k, stream=True, stream_options={"include_usage": True}).response.text
    without = ctx.post(k, stream=True).response.text
    assert '"usage": {' in with_usage and '"usage": {' not in without
    assert ctx.post(k, stream_options={"include_usage": True}).refused("stream_options")


def parallel_calls(ctx, k):
    test_parallel_tool_calls_false_returns_the_first_call_only(ctx)


def tools_rendered(ctx, k):
    from posttrain.data.synthetic_tools import tool_schemas

    a = ctx.post(k, tools=tool_schemas())
    assert a.json["usage"]["prompt_tokens"] > ctx.base(k).json["usage"]["prompt_tokens"]


FIELDS = {
    "model": refused({"model": "nope"}, "model"),
    "messages": holds({"messages": [{"role": "user", "content": "hello there"}]},
                      lambda c, a, k: a.prompts[0] != c.base(k).prompts[0]),
    "prompt": holds({"prompt": "hello there"}, lambda c, a, k: a.prompts[0] != c.base(k).prompts[0]),
    "n": holds({"n": 2}, lambda c, a, k: len(a.choices) == 2),
    "temperature": differs({"temperature": 0.0}),
    "top_p": differs({"top_p": 0.3}),
    "top_k": differs({"top_k": 2}),
    "max_tokens": holds({"max_tokens": 2}, lambda c, a, k: [len(i) for i in a.ids] == [2]),
    "max_completion_tokens": holds({"max_completion_tokens": 3, "max_tokens": ...},
                                   lambda c, a, k: [len(i) for i in a.ids] == [3]),
    "stop": holds({"stop": ["1"], "logit_bias": {"ONE": 100}}, lambda c, a, k: a.text() == ""),
    "seed": differs({"seed": 6}),
    "stream": holds({"stream": True}, lambda c, a, k: a.response.text.startswith("data: ")),
    "stream_options": streamed_usage,
    "presence_penalty": differs({"presence_penalty": 1.5}),
    "frequency_penalty": differs({"frequency_penalty": 1.5}),
    "repetition_penalty": differs({"repetition_penalty": 1.5}),
    "logit_bias": differs({"logit_bias": {"50": 3.0}}),
    "min_p": differs({"min_p": 0.3}),
    "min_tokens": holds({"min_tokens": 3, "logit_bias": {"EOS": 100}}, lambda c, a, k: len(a.ids[0]) == 4),
    "stop_token_ids": holds({"stop_token_ids": ["ONE"], "logit_bias": {"ONE": 100}},
                            lambda c, a, k: a.ids == [[c.one]]),
    "ignore_eos": holds({"ignore_eos": True, "logit_bias": {"EOS": 100}}, lambda c, a, k: len(a.ids[0]) == 6),
    "include_stop_str_in_output": holds({"include_stop_str_in_output": True, "stop": ["1"], "logit_bias": {"ONE": 100}},
                                        lambda c, a, k: a.text() == "1"),
    "skip_special_tokens": holds({"skip_special_tokens": False, "logit_bias": {str(IM_START): 100}},
                                 lambda c, a, k: a.text() == "<|im_start|>" * 6),
    "bad_words": holds({"bad_words": ["1"], "logit_bias": {"ONE": 100}}, lambda c, a, k: c.one not in a.ids[0]),
    "allowed_token_ids": holds({"allowed_token_ids": [40, 41]}, lambda c, a, k: set(a.ids[0]) <= {40, 41}),
    "response_format": constrained({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"enum": ["on", "off"]}}}}, {'"on"', '"off"'}, "response_format"),
    "guided_json": constrained({"guided_json": {"enum": [1, 2]}}, {"1", "2"}, "guided_json"),
    "guided_regex": constrained({"guided_regex": "(ab|cd)"}, {"ab", "cd"}, "guided_regex"),
    "guided_choice": constrained({"guided_choice": ["left", "right"]}, {"left", "right"}, "guided_choice"),
    "guided_grammar": constrained({"guided_grammar": 'start: "p" | "q"'}, {"p", "q"}, "guided_grammar"),
    "structured_outputs": constrained({"structured_outputs": {"regex": "z{3}"}}, {"zzz"}, "structured_outputs"),
    "user": lambda c, k: test_identity_fields_name_the_answer_and_the_log(c, c.caplog),
    "session_id": lambda c, k: test_identity_fields_name_the_answer_and_the_log(c, c.caplog),
    "request_id": holds({"request_id": "r-1"}, lambda c, a, k: a.json["id"].endswith("-r-1")),
    "tools": tools_rendered,
    "tool_choice": holds({"tool_choice": "none", "tools": [{"type": "function", "function": {"name": "f"}}]},
                         lambda c, a, k: a.prompts[0] == c.base(k).prompts[0]),
    "parallel_tool_calls": parallel_calls,
    "logprobs": holds({"logprobs": ...}, lambda c, a, k: a.choices[0]["logprobs"] is None),
    "top_logprobs": holds({"top_logprobs": 2}, lambda c, a, k: all(len(e["top_logprobs"]) == 2
                                                                   for e in a.choices[0]["logprobs"]["content"])),
    "chat_template_kwargs": lambda c, k: test_chat_template_kwargs_reach_the_template(c),
    "echo": holds({"echo": True}, lambda c, a, k: a.text().startswith("12*34=")),
    "suffix": refused({"suffix": "!"}, "suffix"),
    "best_of": refused({"best_of": 3}, "best_of"),
}


@pytest.mark.parametrize("kind, model", [("chat", ChatRequest), ("completion", CompletionRequest)])
def test_every_request_field_acts_or_is_refused_by_name(served, caplog, kind, model):
    missing = sorted(set(model.model_fields) - set(FIELDS))
    assert not missing, f"request fields without a check in FIELDS: {missing}"
    served.caplog = caplog
    for name in model.model_fields:
        FIELDS[name](served, kind)
