"""The OpenAI-compatible server (posttrain.serve), through the real `openai` client against the app served in a
thread on a tiny model: chat, text completions, streaming, n, seeds, log-probs, stop strings, tool calls, every
error a client can cause (as the client's exception and status), the API key, the episode recorder, and the
`posttrain serve` command."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

from posttrain.serve.app import Served, build_app  # noqa: E402
from posttrain.serve.chat import SampleText, tool_message  # noqa: E402
from posttrain.serve.recorder import Recorder  # noqa: E402
from posttrain.serve.scheduler import Event, QueueFull, RequestSampling, Scheduler  # noqa: E402
from posttrain.serve.server import serve_in_thread  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
MODEL = "tiny"
CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "12*34"}}</tool_call>'


@pytest.fixture(scope="module")
def tool_model_dir(tmp_path_factory):
    """The tool task's tiny model: its tokenizer has the tool chat template and the hermes tokens."""
    from posttrain.data.synthetic_tools import tokenizer_corpus
    from posttrain.models.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("serve_tiny"), tokenizer_corpus(0, 300), hidden_size=64,
                            num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128, seed=0, tools=True)


@pytest.fixture(scope="module")
def stack(tool_model_dir):
    """(tokenizer, a copy of the served model, the scheduler, the recorder, base URL) of one served app."""
    from posttrain.models.load import load_causal_lm, load_tokenizer
    from posttrain.models.policy import PolicyModel
    from posttrain.rollout.registry import build_engine

    tokenizer = load_tokenizer(str(tool_model_dir))
    engine = build_engine("posttrain", PolicyModel(load_causal_lm(str(tool_model_dir))), tokenizer,
                          device=torch.device("cpu"), dtype=torch.float32)
    lm = load_causal_lm(str(tool_model_dir)).eval()  # the reference: the scheduler's copy is switched while it decodes
    scheduler = Scheduler(engine, max_running=16, max_waiting=16)
    scheduler.start()
    recorder = Recorder()
    server = serve_in_thread(build_app(Served(MODEL, tokenizer, scheduler), recorder=recorder))
    yield tokenizer, lm, scheduler, recorder, server.base_url
    server.close()
    scheduler.close()


def client(base_url, key="episode-0", **kw):
    return openai.OpenAI(base_url=base_url, api_key=key, max_retries=0, **kw)


def rendered(tokenizer, messages, tools=None) -> list[int]:
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                        **({"tools": tools} if tools else {}))
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def greedy(lm, tokenizer, prompt: list[int], steps: int) -> tuple[list[int], list[float]]:
    """Greedy decoding by the model's own forward over the whole sequence at each step (no cache), float64
    log-softmax; stops after the EOS token."""
    ids, out, logprobs = list(prompt), [], []
    with torch.no_grad():
        for _ in range(steps):
            logits = lm(input_ids=torch.tensor([ids])).logits[0, -1].double()
            token = int(logits.argmax())
            out.append(token)
            logprobs.append(float(torch.log_softmax(logits, -1)[token]))
            ids.append(token)
            if token == tokenizer.eos_token_id:
                break
    return out, logprobs


def text_of(tokenizer, ids) -> str:
    return tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)


USER = [{"role": "user", "content": "12*34="}]


# ---------------------------------------------------------------------------------------------- the happy paths

def test_a_greedy_chat_completion_is_the_models_greedy_text_with_its_logprobs(stack):
    tokenizer, lm, _, recorder, url = stack
    r = client(url, "episode-greedy").chat.completions.create(model=MODEL, messages=USER, max_tokens=12,
                                                               temperature=0, logprobs=True)
    prompt = rendered(tokenizer, USER)
    ids, logprobs = greedy(lm, tokenizer, prompt, 12)
    choice = r.choices[0]
    assert choice.message.role == "assistant" and choice.message.content == text_of(tokenizer, ids)
    assert choice.finish_reason == ("stop" if ids[-1] == tokenizer.eos_token_id else "length")
    assert r.usage.prompt_tokens == len(prompt) and r.usage.completion_tokens == len(ids)
    assert r.object == "chat.completion" and r.model == MODEL
    got = [e.logprob for e in choice.logprobs.content]
    assert got == pytest.approx(logprobs, abs=1e-4)
    assert [e.token for e in choice.logprobs.content] == [tokenizer.decode([t]) for t in ids]
    # recorded under the client's key: the exact prompt, the sampled ids and their log-probs
    calls, reward = recorder.take("episode-greedy")
    assert reward is None and len(calls) == 1
    assert calls[0].prompt_ids == prompt and calls[0].completion_ids == ids
    assert calls[0].logprobs == pytest.approx(logprobs, abs=1e-4) and calls[0].finish_reason == choice.finish_reason


def test_streamed_deltas_join_to_the_unstreamed_greedy_text(stack):
    tokenizer, lm, _, _, url = stack
    c = client(url)
    whole = c.chat.completions.create(model=MODEL, messages=USER, max_tokens=20, temperature=0, logprobs=True)
    chunks = list(c.chat.completions.create(model=MODEL, messages=USER, max_tokens=20, temperature=0, stream=True,
                                            stream_options={"include_usage": True}, logprobs=True))
    with_choice = [ch for ch in chunks if ch.choices]
    assert with_choice[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in with_choice) == whole.choices[0].message.content
    assert [ch.choices[0].finish_reason for ch in with_choice if ch.choices[0].finish_reason] == \
        [whole.choices[0].finish_reason]
    streamed_logprobs = [e for ch in with_choice if ch.choices[0].logprobs for e in ch.choices[0].logprobs.content]
    assert [(e.token, e.logprob) for e in streamed_logprobs] == \
        [(e.token, e.logprob) for e in whole.choices[0].logprobs.content]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens


def test_streamed_text_completion_joins_to_the_unstreamed_text(stack):
    _, _, _, _, url = stack
    c = client(url)
    whole = c.completions.create(model=MODEL, prompt="7+8=", max_tokens=16, temperature=0)
    parts = list(c.completions.create(model=MODEL, prompt="7+8=", max_tokens=16, temperature=0, stream=True))
    assert "".join(p.choices[0].text for p in parts) == whole.choices[0].text
    assert parts[-1].choices[0].finish_reason == whole.choices[0].finish_reason


def test_n_samples_and_a_seed_reproduce_the_same_choices(stack):
    _, _, _, _, url = stack
    c = client(url)
    ask = dict(model=MODEL, messages=USER, max_tokens=8, temperature=1.0, n=3, seed=1234, logprobs=True)
    first, again = c.chat.completions.create(**ask), c.chat.completions.create(**ask)
    assert [ch.index for ch in first.choices] == [0, 1, 2]
    assert [ch.message.content for ch in first.choices] == [ch.message.content for ch in again.choices]
    assert [[e.logprob for e in ch.logprobs.content] for ch in first.choices] == \
        [[e.logprob for e in ch.logprobs.content] for ch in again.choices]
    assert first.usage.completion_tokens == sum(len(ch.logprobs.content) for ch in first.choices)
    assert all(e.logprob <= 0 for ch in first.choices for e in ch.logprobs.content)


def test_text_completions_take_a_string_or_token_ids_and_several_prompts(stack):
    tokenizer, lm, _, _, url = stack
    c = client(url)
    ids = tokenizer("3+4=")["input_ids"]
    by_text = c.completions.create(model=MODEL, prompt="3+4=", max_tokens=10, temperature=0, logprobs=0)
    by_ids = c.completions.create(model=MODEL, prompt=ids, max_tokens=10, temperature=0)
    want, logprobs = greedy(lm, tokenizer, ids, 10)
    assert by_text.choices[0].text == by_ids.choices[0].text == text_of(tokenizer, want)
    assert by_text.choices[0].logprobs.token_logprobs == pytest.approx(logprobs, abs=1e-4)
    assert by_text.object == "text_completion" and by_text.usage.prompt_tokens == len(ids)
    both = c.completions.create(model=MODEL, prompt=["3+4=", "5+6="], max_tokens=4, temperature=0, n=2)
    assert [ch.index for ch in both.choices] == [0, 1, 2, 3]
    assert both.choices[0].text == both.choices[1].text == text_of(tokenizer, want[:4])


def test_a_stop_string_cuts_the_text_where_it_starts_streamed_or_not(stack):
    _, _, _, _, url = stack
    c = client(url)
    ask = dict(model=MODEL, prompt="12*34=", max_tokens=24, temperature=1.0, seed=5)  # greedy text repeats one token
    full = c.completions.create(**ask).choices[0].text
    cut = next(k for k in range(1, len(full) - 2)
               if full.find(full[k:k + 2]) == k and "\ufffd" not in full[:k + 2])
    stop = full[cut:cut + 2]
    r = c.completions.create(**ask, stop=[stop, "zzzz"])
    assert r.choices[0].text == full[:cut] and r.choices[0].finish_reason == "stop"
    parts = list(c.completions.create(**ask, stop=stop, stream=True))
    assert "".join(p.choices[0].text for p in parts) == full[:cut]
    assert parts[-1].choices[0].finish_reason == "stop"


def test_concurrent_requests_get_what_each_gets_alone(stack):
    """Requests decoding in one batch (joining and leaving it at different steps) answer as they do alone."""
    _, _, _, _, url = stack
    c = client(url)
    asks = [dict(model=MODEL, messages=[{"role": "user", "content": f"{a}*{a + 7}="}], max_tokens=4 + 3 * a,
                 temperature=0 if a % 2 else 0.8, seed=a) for a in range(6)]
    alone = [c.chat.completions.create(**ask).choices[0].message.content for ask in asks]
    together = [None] * len(asks)

    def ask_one(i):
        together[i] = c.chat.completions.create(**asks[i]).choices[0].message.content
    threads = [threading.Thread(target=ask_one, args=(i,)) for i in range(len(asks))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert together == alone


def test_models_and_health(stack):
    _, _, scheduler, _, url = stack
    models = client(url).models.list()
    assert [m.id for m in models.data] == [MODEL]
    health = httpx.get(url.removesuffix("/v1") + "/health").json()
    assert health["status"] == "ok" and health["stats"]["requests"] >= 0
    blocks = health["stats"]
    assert blocks["kv_block_size"] in (0, 16) and blocks["kv_blocks_used"] >= blocks["kv_blocks_shared"] >= 0


# ---------------------------------------------------------------------------------------------- tool calls

def test_a_hermes_turn_becomes_content_and_openai_tool_calls():
    content, calls = tool_message("Let me compute. " + CALL, tools_on=True)
    assert content == "Let me compute."
    assert [(c["type"], c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == \
        [("function", "calculator", {"expression": "12*34"})]
    assert calls[0]["id"].startswith("call_")
    assert tool_message(CALL + CALL, True)[0] is None and len(tool_message(CALL + CALL, True)[1]) == 2
    broken = "<tool_call>{not json}</tool_call>"
    assert tool_message(broken, True) == (broken, [])  # a malformed call stays text
    assert tool_message(CALL, tools_on=False) == (CALL, [])  # no tools offered: no parsing


def test_streamed_text_holds_back_a_tool_call_and_stop_string_prefixes(tool_model_dir):
    from posttrain.models.load import load_tokenizer

    tokenizer = load_tokenizer(str(tool_model_dir))
    text = "Sure. " + CALL
    sample, sent = SampleText(tokenizer, watch="<tool_call>"), ""
    for t in tokenizer(text)["input_ids"]:
        sent += sample.push(t, -1.0)
    sent += sample.finish()
    assert sent == "Sure. " and sample.tail() == CALL and sample.text == text
    sample, sent = SampleText(tokenizer, stops=["34="]), ""
    for t in tokenizer("12*34=408")["input_ids"]:
        sent += sample.push(t, -1.0)
        assert not sent.endswith("3")  # the start of the stop string waits
    assert sent + sample.finish() == "12*" and sample.stopped


def test_incremental_text_is_the_text_of_all_ids_also_across_split_characters(tool_model_dir):
    """Byte-level tokens split multi-byte characters: a token ending inside one gives no text until the character is
    complete, and the pieces joined are the decoding of all ids at once."""
    from posttrain.models.load import load_tokenizer

    tokenizer = load_tokenizer(str(tool_model_dir))
    for text in ("héllo wörld ✓ 日本語 🙂 end", "12*34=408\n\n<tool_call>x", "  spaces  and\ttabs "):
        ids = tokenizer(text)["input_ids"] + [tokenizer.eos_token_id]
        sample, pieces = SampleText(tokenizer), []
        for t in ids:
            pieces.append(sample.push(t, 0.0))
            assert "\ufffd" not in pieces[-1]
        pieces.append(sample.finish())
        assert "".join(pieces) == text_of(tokenizer, ids) == text and sample.ids == ids
        assert sum(1 for p in pieces if p) > 3  # it did come piece by piece


class FixedScheduler:
    """A scheduler (Contract 1's interface) whose every sample is the same fixed token ids, then EOS: the parse path
    of a turn the untrained tiny model would never write."""

    context_length = 512

    def __init__(self, ids: list[int], eos: int, finish: str = "stop"):
        self.ids, self.eos, self.finish, self.prompts = ids, eos, finish, []

    def submit(self, prompt_ids, n, sampling):
        self.prompts.append(list(prompt_ids))
        return FixedHandle([Event(s, t, -0.25) for s in range(n) for t in self.ids + [self.eos]] +
                           [Event(s, None, None, self.finish) for s in range(n)])


class FixedHandle:
    def __init__(self, events):
        self._events, self.cancelled = events, []

    def take(self):
        events, self._events = self._events, []
        return events

    def notify(self, loop, callback, final=False):
        return not self._events

    def cancel(self, sample=None):
        self.cancelled.append(sample)


def test_tool_calls_reach_the_client_unstreamed_and_streamed(tool_model_dir):
    from posttrain.data.synthetic_tools import tool_schemas
    from posttrain.models.load import load_tokenizer

    tokenizer = load_tokenizer(str(tool_model_dir))
    fixed = FixedScheduler(tokenizer(CALL)["input_ids"], tokenizer.eos_token_id)
    recorder = Recorder()
    with serve_in_thread(build_app(Served(MODEL, tokenizer, fixed), recorder=recorder)) as server:
        c = client(server.base_url, "ep-tools")
        r = c.chat.completions.create(model=MODEL, messages=USER, tools=tool_schemas(), tool_choice="auto")
        (call,) = r.choices[0].message.tool_calls
        assert r.choices[0].finish_reason == "tool_calls" and r.choices[0].message.content is None
        assert call.function.name == "calculator" and json.loads(call.function.arguments) == {"expression": "12*34"}
        assert fixed.prompts[-1] == rendered(tokenizer, USER, tool_schemas())  # the tools are in the prompt
        chunks = list(c.chat.completions.create(model=MODEL, messages=USER, tools=tool_schemas(), stream=True))
        deltas = [d for ch in chunks for d in (ch.choices[0].delta.tool_calls or [])]
        assert [(d.index, d.function.name, json.loads(d.function.arguments)) for d in deltas] == \
            [(0, "calculator", {"expression": "12*34"})]
        assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == ""
        assert chunks[-1].choices[0].finish_reason == "tool_calls"
        # the tool's answer in the next request: the assistant's call renders as the template writes it
        follow = USER + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                         {"role": "tool", "tool_call_id": call.id, "content": "408"}]
        c.chat.completions.create(model=MODEL, messages=follow, tools=tool_schemas())
        direct = USER + [{"role": "assistant", "content": "",
                          "tool_calls": [{"function": {"name": "calculator", "arguments": {"expression": "12*34"}}}]},
                         {"role": "tool", "content": "408"}]
        assert fixed.prompts[-1] == rendered(tokenizer, direct, tool_schemas())
        assert text_of(tokenizer, fixed.prompts[-1]).count(CALL) == 1
        calls, _ = recorder.take("ep-tools")
        assert [c.finish_reason for c in calls] == ["tool_calls"] * 3
        assert calls[0].completion_ids == fixed.ids + [tokenizer.eos_token_id]
        # tool_choice none: no tools rendered, the text left as it is
        r = c.chat.completions.create(model=MODEL, messages=USER, tools=tool_schemas(), tool_choice="none")
        assert r.choices[0].message.content == CALL and not r.choices[0].message.tool_calls
        assert fixed.prompts[-1] == rendered(tokenizer, USER)


# ---------------------------------------------------------------------------------------------- errors

def status_error(call) -> "openai.APIStatusError":
    with pytest.raises(openai.APIStatusError) as e:
        call()
    return e.value


def test_every_bad_request_is_an_openai_error_and_the_server_serves_on(stack):
    tokenizer, _, _, _, url = stack
    c = client(url)
    e = status_error(lambda: c.chat.completions.create(model="nope", messages=USER))
    assert isinstance(e, openai.NotFoundError) and e.code == "model_not_found"
    too_long = [{"role": "user", "content": "1234567890" * 100}]
    e = status_error(lambda: c.chat.completions.create(model=MODEL, messages=too_long, max_tokens=4))
    assert isinstance(e, openai.BadRequestError) and "context" in e.message
    e = status_error(lambda: c.chat.completions.create(model=MODEL, messages=USER, max_tokens=100_000))
    assert isinstance(e, openai.BadRequestError) and "context" in e.message
    e = status_error(lambda: c.completions.create(model=MODEL, prompt=[len(tokenizer) + 50], max_tokens=2))
    assert isinstance(e, openai.BadRequestError)
    for refused in (dict(top_logprobs=2), dict(tool_choice="required"), dict(presence_penalty=3.0),  # no tools
                    dict(response_format={"type": "xml"}), dict(extra_body={"use_beam_search": True})):
        e = status_error(lambda: c.chat.completions.create(model=MODEL, messages=USER, max_tokens=2, **refused))
        assert isinstance(e, openai.BadRequestError), refused
    e = status_error(lambda: c.chat.completions.create(model=MODEL, messages=[]))
    assert isinstance(e, openai.BadRequestError) and e.body["param"] == "messages"
    e = status_error(lambda: c.chat.completions.create(model=MODEL, messages=USER, n=0))
    assert isinstance(e, openai.BadRequestError)
    for body, headers in (("{not json", {"content-type": "application/json"}), ("[1, 2]", {})):
        r = httpx.post(url + "/chat/completions", content=body, headers=headers)
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", r.text
    r = httpx.get(url + "/no/such/route")
    assert r.status_code == 404 and "error" in r.json()
    assert c.chat.completions.create(model=MODEL, messages=USER, max_tokens=2).choices[0].message is not None


def test_a_failed_decoding_is_answered_500_and_not_recorded(tool_model_dir):
    from posttrain.models.load import load_tokenizer

    tokenizer = load_tokenizer(str(tool_model_dir))
    recorder = Recorder()
    failing = FixedScheduler(tokenizer("12")["input_ids"], tokenizer.eos_token_id, finish="error")
    with serve_in_thread(build_app(Served(MODEL, tokenizer, failing), recorder=recorder)) as server:
        c = client(server.base_url, "ep-failed")
        e = status_error(lambda: c.chat.completions.create(model=MODEL, messages=USER))
        assert isinstance(e, openai.InternalServerError) and e.status_code == 500
        with pytest.raises(openai.APIError):  # streamed: the first event is a token, then the error event
            list(c.chat.completions.create(model=MODEL, messages=USER, stream=True))
    assert recorder.take("ep-failed") == ([], None)


class Spy:
    """The scheduler, with the handles it gave out and their cancels seen. `hold`: after each request's first
    event the app sees no more until `release` is set (the request cannot end meanwhile)."""

    def __init__(self, scheduler, hold: bool = False):
        self.scheduler, self.handles, self.hold = scheduler, [], hold
        self.release = threading.Event()

    @property
    def context_length(self):
        return self.scheduler.context_length

    def submit(self, *args):
        handle = self.scheduler.submit(*args)
        handle.cancels = []
        cancel, take, notify = handle.cancel, handle.take, handle.notify
        seen = []

        def spied(sample=None):
            handle.cancels.append(sample)
            cancel(sample)

        def holding():
            return self.hold and seen and not self.release.is_set()

        def held_take():
            if holding():
                return []
            events = take()
            if self.hold and events and not seen:
                seen.append(events[0])
                handle._events.extendleft(reversed(events[1:]))  # back in front, for after the release
                return events[:1]
            return events

        def held_notify(loop, callback, final=False):
            if holding():  # looked at again shortly, as a reader polling would
                loop.call_later(0.01, callback)
                return True
            return notify(loop, callback, final)
        handle.cancel, handle.take, handle.notify = spied, held_take, held_notify
        self.handles.append(handle)
        return handle


def wait_for(condition, seconds=20.0):
    end = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < end, "timed out waiting"
        time.sleep(0.02)


def test_a_request_over_its_time_limit_is_cancelled_and_answered_504(stack):
    tokenizer, _, scheduler, _, url = stack
    spy = Spy(scheduler)
    ask = dict(model=MODEL, messages=USER, max_tokens=400, temperature=0)
    with serve_in_thread(build_app(Served(MODEL, tokenizer, spy), request_timeout_s=0.3)) as server:
        c = client(server.base_url)
        for stream in (False, True):
            with scheduler.paused():  # nothing decodes: the time limit passes before the first token
                e = status_error(lambda: list(c.chat.completions.create(**ask, stream=stream)))
            assert e.status_code == 504 and e.code == "timeout"
            assert spy.handles[-1].cancels[:1] == [None]  # every sample of it cancelled
        # the limit passes after the first chunk: the stream ends with an error event
        chunks = c.chat.completions.create(**ask, stream=True)
        next(iter(chunks))
        with scheduler.paused(), pytest.raises(openai.APIError) as e:
            list(chunks)
        assert e.value.body["code"] == "timeout" and spy.handles[-1].cancels[:1] == [None]
    assert client(url).chat.completions.create(model=MODEL, messages=USER, max_tokens=2).choices


def test_a_full_queue_is_answered_429_and_a_request_that_never_fits_400(stack):
    tokenizer, _, scheduler, _, _ = stack
    full = Scheduler(scheduler.engine, max_running=2, max_waiting=2)  # never started: what waits stays
    full.submit([1, 2], 1, RequestSampling())
    with serve_in_thread(build_app(Served(MODEL, tokenizer, full))) as server:
        c = client(server.base_url)
        e = status_error(lambda: c.completions.create(model=MODEL, prompt=["1+1=", "2+2="]))  # one place left
        assert isinstance(e, openai.RateLimitError) and e.status_code == 429
        assert full.stats["requests_waiting"] == 1  # the prompt that fitted was taken back
        # more prompts than may ever wait, more samples than may ever run: no retry helps
        e = status_error(lambda: c.completions.create(model=MODEL, prompt=["1+1="] * 3))
        assert isinstance(e, openai.BadRequestError) and e.body["param"] == "prompt" and "max_waiting" in e.message
        e = status_error(lambda: c.chat.completions.create(model=MODEL, messages=USER, n=3))
        assert isinstance(e, openai.BadRequestError) and e.body["param"] == "n" and "max_running" in e.message
    full.submit([1, 2], 1, RequestSampling())
    with pytest.raises(QueueFull):
        full.submit([1, 2], 1, RequestSampling())


def test_a_client_gone_mid_stream_has_its_samples_cancelled(stack):
    tokenizer, _, scheduler, _, url = stack
    spy = Spy(scheduler, hold=True)
    with serve_in_thread(build_app(Served(MODEL, tokenizer, spy))) as server:
        body = {"model": MODEL, "messages": USER, "max_tokens": 400, "temperature": 0, "stream": True, "n": 2}
        with httpx.stream("POST", server.base_url + "/chat/completions", json=body, timeout=30) as r:
            assert r.status_code == 200
            next(r.iter_lines())
        wait_for(lambda: None in spy.handles[0].cancels, 5)
        spy.release.set()
    assert client(url).chat.completions.create(model=MODEL, messages=USER, max_tokens=2).choices


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_gone_before_its_answer_has_its_samples_cancelled(stack, stream):
    tokenizer, _, scheduler, _, _ = stack
    spy = Spy(scheduler)
    with serve_in_thread(build_app(Served(MODEL, tokenizer, spy))) as server, scheduler.paused():
        body = {"model": MODEL, "messages": USER, "max_tokens": 400, "temperature": 0, "stream": stream}
        with pytest.raises(httpx.TimeoutException):  # a stream waits for its first token before it starts
            httpx.post(server.base_url + "/chat/completions", json=body, timeout=0.5)
        wait_for(lambda: spy.handles and None in spy.handles[0].cancels, 5)


def test_reading_a_cancelled_generation_ends_at_once_not_at_its_deadline(tool_model_dir):
    """A client gone before its answer: the request's handler stops waiting (nothing would read its answer)."""
    from posttrain.models.load import load_tokenizer
    from posttrain.serve.generation import Cancelled, Generation

    class Silent:  # a request whose samples never produce an event
        cancelled = []

        def take(self):
            return []

        def notify(self, loop, callback, final=False):
            return True

        def cancel(self, sample=None):
            self.cancelled.append(sample)

    tokenizer = load_tokenizer(str(tool_model_dir))

    async def scenario():
        handle = Silent()
        gen = Generation([handle], 1, [SampleText(tokenizer)], deadline=time.monotonic() + 600)

        async def read():
            async for _ in gen.updates():
                pass
        reader = asyncio.ensure_future(read())
        await asyncio.sleep(0.05)
        gen.cancel()
        with pytest.raises(Cancelled):
            await asyncio.wait_for(reader, 5)
        return handle.cancelled

    assert asyncio.run(scenario()) == [None]


def test_an_api_key_is_required_when_set(stack):
    tokenizer, _, scheduler, _, _ = stack
    with serve_in_thread(build_app(Served(MODEL, tokenizer, scheduler), api_key="sesame")) as server:
        e = status_error(lambda: client(server.base_url, "wrong").models.list())
        assert isinstance(e, openai.AuthenticationError) and e.status_code == 401
        assert httpx.post(server.base_url + "/chat/completions", json={}).status_code == 401
        assert client(server.base_url, "sesame").chat.completions.create(model=MODEL, messages=USER, max_tokens=2)
        assert httpx.get(server.base_url.removesuffix("/v1") + "/health").status_code == 200


# ---------------------------------------------------------------------------------------------- the recorder

def test_calls_are_recorded_by_episode_id_from_the_header_or_the_key_and_rewards_posted(stack):
    tokenizer, _, _, recorder, url = stack
    c = client(url, "ep-key")
    c.chat.completions.create(model=MODEL, messages=USER, max_tokens=3, temperature=0)
    r = c.chat.completions.create(model=MODEL, messages=USER, max_tokens=3, n=2, logprobs=True,
                                  extra_headers={"X-Episode-Id": "ep-header"})
    c.completions.create(model=MODEL, prompt="1+1=", max_tokens=2)
    root = url.removesuffix("/v1")
    assert httpx.post(root + "/rl/reward", json={"reward": 0.5}, headers={"Authorization": "Bearer ep-key"}).json() \
        == {"episode": "ep-key", "reward": 0.5}
    assert httpx.post(root + "/rl/reward", json={"reward": 1}, headers={"X-Episode-Id": "ep-header"}).status_code == 200
    assert httpx.post(root + "/rl/reward", json={"reward": "x"}, headers={"X-Episode-Id": "e"}).status_code == 400
    assert httpx.post(root + "/rl/reward", json={"reward": 1}).status_code == 400  # no episode id
    by_key, reward = recorder.take("ep-key")
    assert reward == 0.5 and len(by_key) == 2
    assert by_key[0].prompt_ids == rendered(tokenizer, USER) and len(by_key[0].completion_ids) == 3
    assert by_key[1].prompt_ids == tokenizer("1+1=")["input_ids"]
    by_header, reward = recorder.take("ep-header")
    assert reward == 1.0 and len(by_header) == 2
    for call, choice in zip(by_header, r.choices):
        assert text_of(tokenizer, call.completion_ids) == choice.message.content
        assert call.logprobs == [e.logprob for e in choice.logprobs.content]
    assert recorder.take("ep-header") == ([], None)


def test_sampling_override_sets_the_distribution_and_caps_max_tokens(stack):
    tokenizer, lm, scheduler, _, _ = stack
    recorder = Recorder()
    override = RequestSampling(temperature=0.0, max_tokens=3)
    with serve_in_thread(build_app(Served(MODEL, tokenizer, scheduler), recorder=recorder,
                                   sampling_override=override)) as server:
        r = client(server.base_url, "ep").chat.completions.create(model=MODEL, messages=USER, max_tokens=50,
                                                                 temperature=1.5, top_p=0.5)
    want, _ = greedy(lm, tokenizer, rendered(tokenizer, USER), 3)
    assert r.choices[0].message.content == text_of(tokenizer, want)
    assert recorder.take("ep")[0][0].completion_ids == want


def test_in_training_a_clients_seed_is_dropped_and_counted(stack):
    """n runs of one row sending one fixed seed must not draw one sample n times (a group without variance): with a
    sampling override the client's seed is ignored, and the recorder counts it."""
    tokenizer, _, scheduler, _, _ = stack
    recorder = Recorder()
    override = RequestSampling(temperature=1.0, max_tokens=8)
    with serve_in_thread(build_app(Served(MODEL, tokenizer, scheduler), recorder=recorder,
                                   sampling_override=override)) as server:
        c = client(server.base_url, "ep-seeded")
        answers = [c.chat.completions.create(model=MODEL, messages=USER, seed=7).choices[0].message.content
                   for _ in range(3)]
        c.chat.completions.create(model=MODEL, messages=USER)  # no seed: nothing dropped
    assert len(set(answers)) > 1
    assert recorder.counts() == {"seeds_dropped": 3}


def full_forward_logprobs(lm, prompt: list[int], tokens: list[int], temperature: float = 1.0) -> list[float]:
    """log-softmax(logits / temperature) of a full float64 forward at each sampled token."""
    with torch.no_grad():
        logits = lm(input_ids=torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1].double()
    return torch.log_softmax(logits / temperature, dim=-1)[torch.arange(len(tokens)), tokens].tolist()


def test_clients_see_the_raw_distributions_logprobs_and_training_records_the_sampled_ones(stack):
    """`logprobs` reports each token's log-prob under the model's own distribution (vLLM's default logprobs_mode,
    raw_logprobs) whatever the temperature, so temperature 0 and 1e-6 (greedy below vLLM's epsilon) agree; the
    recorder keeps the log-prob of the distribution the token was drawn from (training's behaviour policy)."""
    tokenizer, lm, _, recorder, url = stack
    c = client(url, "ep-logprobs")
    prompt = rendered(tokenizer, USER)
    greedy_ids, greedy_logprobs = greedy(lm, tokenizer, prompt, 6)
    for temperature in (0, 1e-6):
        r = c.chat.completions.create(model=MODEL, messages=USER, max_tokens=6, temperature=temperature,
                                      logprobs=True)
        assert [e.logprob for e in r.choices[0].logprobs.content] == pytest.approx(greedy_logprobs, abs=1e-4)
    r = c.chat.completions.create(model=MODEL, messages=USER, max_tokens=6, temperature=0.5, seed=3, logprobs=True)
    streamed = c.chat.completions.create(model=MODEL, messages=USER, max_tokens=6, temperature=0.5, seed=3,
                                         logprobs=True, stream=True)
    streamed = [e.logprob for ch in streamed if ch.choices and ch.choices[0].logprobs
                for e in ch.choices[0].logprobs.content]
    calls, _ = recorder.take("ep-logprobs")  # two greedy, the sampled one, streamed the same
    assert [call.logprobs for call in calls[:2]] == [pytest.approx(greedy_logprobs, abs=1e-4)] * 2
    ids = calls[2].completion_ids
    shown = [e.logprob for e in r.choices[0].logprobs.content]
    assert shown == pytest.approx(full_forward_logprobs(lm, prompt, ids), abs=1e-4) and streamed == shown
    assert calls[2].logprobs == pytest.approx(full_forward_logprobs(lm, prompt, ids, 0.5), abs=1e-4)
    assert calls[3].logprobs == calls[2].logprobs


@pytest.mark.parametrize("tiny", [dict(temperature=1e-300), dict(top_p=1e-300), dict(temperature=1e-6, top_p=1e-9)])
def test_a_vanishing_temperature_or_top_p_decodes_greedily_with_finite_logprobs(stack, tiny):
    tokenizer, lm, _, _, url = stack
    prompt = rendered(tokenizer, USER)
    want, logprobs = greedy(lm, tokenizer, prompt, 5)
    for stream in (False, True):  # a stream's JSON too: nothing non-finite
        r = httpx.post(url + "/chat/completions", json={"model": MODEL, "messages": USER, "max_tokens": 5,
                                                        "logprobs": True, "stream": stream, **tiny}, timeout=60)
        assert r.status_code == 200 and "Infinity" not in r.text and "NaN" not in r.text
    r = client(url).chat.completions.create(model=MODEL, messages=USER, max_tokens=5, logprobs=True, **tiny)
    assert r.choices[0].message.content == text_of(tokenizer, want)
    assert [e.logprob for e in r.choices[0].logprobs.content] == pytest.approx(logprobs, abs=1e-4)


# ---------------------------------------------------------------------------------------------- the command

def test_posttrain_serve_answers_health_and_a_chat_completion(tool_model_dir):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "posttrain", "serve", str(tool_model_dir), "--port", "0",
                             "--served-model-name", "t", "--device", "cpu"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)
    try:
        line = proc.stdout.readline()
        assert line.startswith("serving t at http://127.0.0.1:"), line + proc.stderr.read()
        base_url = line.split(" at ")[1].strip()
        assert httpx.get(base_url.removesuffix("/v1") + "/health").json()["status"] == "ok"
        r = client(base_url).chat.completions.create(model="t", messages=USER, max_tokens=3)
        assert r.choices[0].finish_reason in ("stop", "length")
    finally:
        proc.terminate()
        assert proc.wait(timeout=30) == 0
