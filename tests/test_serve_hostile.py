"""`posttrain serve` against clients that send what they should not: bodies too big, malformed or nested without
end; fields of the wrong type or out of range; text that is not text; clients that go away mid-request or mid-
stream, that stall in their headers or trickle their body, that hold connections open; and a SIGTERM with requests
in flight. Each gets an OpenAI error body (the `openai` client's exception, `param` naming the field) or its answer,
and the server serves on, its memory where it was (docs/reliability.md, "The server against hostile clients").

One server (module-scoped, with small limits so that the slow cases take a second or two) serves every case but
SIGTERM's, which runs `posttrain serve` in a subprocess."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

from posttrain.serve.app import Served, build_app  # noqa: E402
from posttrain.serve.limits import Limits  # noqa: E402
from posttrain.serve.recorder import Recorder  # noqa: E402
from posttrain.serve.scheduler import Scheduler  # noqa: E402
from posttrain.serve.server import serve_in_thread  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
MODEL = "tiny"
USER = [{"role": "user", "content": "12*34="}]
LIMITS = Limits(max_body_bytes=2**20, read_timeout_s=1.5, keep_alive_s=1.0, max_header_bytes=8192,
                max_connections=40)
MAX_RUNNING, MAX_WAITING = 4, 4


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from posttrain.data.synthetic_tools import tokenizer_corpus
    from posttrain.models.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("hostile_tiny"), tokenizer_corpus(0, 300), hidden_size=64,
                            num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128, seed=0, tools=True)


@pytest.fixture(scope="module")
def srv(model_dir):
    from posttrain.models.load import load_causal_lm, load_tokenizer
    from posttrain.models.policy import PolicyModel
    from posttrain.rollout.registry import build_engine

    tokenizer = load_tokenizer(str(model_dir))
    engine = build_engine("posttrain", PolicyModel(load_causal_lm(str(model_dir))), tokenizer,
                          device=torch.device("cpu"), dtype=torch.float32)
    scheduler = Scheduler(engine, max_running=MAX_RUNNING, max_waiting=MAX_WAITING)
    scheduler.start()
    recorder = Recorder()
    server = serve_in_thread(build_app(Served(MODEL, tokenizer, scheduler), recorder=recorder, limits=LIMITS),
                             limits=LIMITS)
    url = server.base_url
    # warmed up: the first requests' one-time costs (and the openai client's, which lives in this process too) are
    # not counted in the memory before
    assert complete(url).status_code == 200
    assert list(client(url).chat.completions.create(model=MODEL, messages=USER, max_tokens=2, stream=True))
    yield SimpleNamespace(url=url, root=url.removesuffix("/v1"), port=server.port, tokenizer=tokenizer,
                          scheduler=scheduler, server=server, rss_before=rss_mb())
    server.close()
    scheduler.close()


def client(url, **kw):
    return openai.OpenAI(base_url=url, api_key="EMPTY", max_retries=0, timeout=30, **kw)


def complete(url, **fields) -> httpx.Response:
    body = {"model": MODEL, "messages": USER, "max_tokens": 2, **fields}
    return httpx.post(url + "/chat/completions", json=body, timeout=30)


def post(url, path: str, content, headers=None) -> httpx.Response:
    if not isinstance(content, (bytes, str)) and not hasattr(content, "__next__"):
        content = json.dumps(content)
    return httpx.post(url + path, content=content, timeout=30,
                      headers={"content-type": "application/json", **(headers or {})})


def refused(r: httpx.Response, status: int = 400, param=..., says: str | None = None) -> dict:
    """`r` is an OpenAI error of `status` (with `param`, and a message containing `says`)."""
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json"), r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"], error
    if param is not ...:
        assert error["param"] == param, error
    if says is not None:
        assert says in error["message"], error
    return error


def raw(port: int, data: bytes = b"", wait_s: float = 10.0) -> bytes:
    """What the server sends on a connection that sends `data` and then nothing, until it closes it."""
    with socket.create_connection(("127.0.0.1", port), timeout=wait_s) as s:
        s.sendall(data)
        out = b""
        while chunk := s.recv(65536):
            out += chunk
        return out


def status_of(response: bytes) -> int:
    return int(response.split(b" ", 2)[1])


def json_of(response: bytes) -> dict:
    return json.loads(response.split(b"\r\n\r\n", 1)[1])


def wait_for(condition, seconds: float = 10.0) -> None:
    end = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < end, "timed out waiting"
        time.sleep(0.02)


def idle(srv) -> bool:
    stats = srv.scheduler.stats
    return stats["samples_running"] == 0 and stats["requests_waiting"] == 0


# ---------------------------------------------------------------------------------------------- bodies

def test_a_body_announced_over_the_limit_is_refused_before_it_is_sent(srv):
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            f"content-length: {20 * 2**20}\r\n\r\n").encode()
    response = raw(srv.port, head)
    assert status_of(response) == 413 and json_of(response)["error"]["code"] == "request_too_large"


def test_a_20_mb_body_is_refused_and_the_server_answers_the_next_request(srv):
    megabyte = b" " * 2**20  # sent 20 times: the client holds no 20 MB either (its memory is this process's)
    r = post(srv.url, "/chat/completions", (megabyte for _ in range(20)), {"content-length": str(20 * 2**20)})
    refused(r, 413)
    assert complete(srv.url).status_code == 200


def test_a_chunked_body_is_cut_at_the_limit(srv):
    def chunks():  # no Content-Length: read until the limit, then refused
        for _ in range(40):
            yield b" " * 2**16
    refused(post(srv.url, "/chat/completions", chunks()), 413, says=str(LIMITS.max_body_bytes))


@pytest.mark.parametrize("body", [b"", b"[]", b'"text"', b"null", b"1"])
def test_a_body_that_is_not_a_json_object_is_refused(srv, body):
    refused(post(srv.url, "/chat/completions", body), param=None, says="JSON object")


def test_malformed_json_says_where_and_names_no_field(srv):
    error = refused(post(srv.url, "/chat/completions", b'{"model": "tiny",\n "messages": [}'), param=None)
    assert "line 2, column 15" in error["message"]


def test_truncated_json_is_refused(srv):
    refused(post(srv.url, "/completions", b'{"model": "tiny", "prompt": "abc'), param=None, says="not valid JSON")


def test_json_nested_without_end_is_refused(srv):
    refused(post(srv.url, "/chat/completions", b"[" * 100_000 + b"]" * 100_000), param=None, says="nested")


def test_bytes_that_are_not_utf8_are_refused(srv):
    refused(post(srv.url, "/chat/completions", b'{"model": "tiny", "messages": "\xff\xfe"}'), param=None,
            says="UTF-8")


def test_a_body_without_a_json_content_type_is_refused(srv):
    r = httpx.post(srv.url + "/chat/completions", content=json.dumps({"model": MODEL, "messages": USER}),
                   headers={"content-type": "text/plain"}, timeout=30)
    refused(r, param=None, says="Content-Type")


def test_an_infinite_reward_is_refused(srv):
    refused(post(srv.root, "/rl/reward", b'{"reward": 1e999}', {"x-episode-id": "e"}), param="reward")


def test_unknown_routes_and_methods_are_openai_errors(srv):
    refused(httpx.get(srv.url + "/no/such/route"), 404)
    refused(httpx.get(srv.url + "/chat/completions"), 405)


def test_prompts_are_tokenized_off_the_event_loop(srv):
    """While one request's prompt is being tokenized (held here), the server answers others."""
    entered, release = threading.Event(), threading.Event()

    class Held:
        def __init__(self, tokenizer):
            self._tokenizer = tokenizer

        def __call__(self, *args, **kw):
            entered.set()
            assert release.wait(30)
            return self._tokenizer(*args, **kw)

        def __len__(self):
            return len(self._tokenizer)

        def __getattr__(self, name):
            return getattr(self._tokenizer, name)

    app = build_app(Served(MODEL, Held(srv.tokenizer), srv.scheduler), limits=LIMITS)
    with serve_in_thread(app, limits=LIMITS) as server:
        answer = []
        held = threading.Thread(target=lambda: answer.append(httpx.post(
            server.base_url + "/completions", json={"model": MODEL, "prompt": "7+8=", "max_tokens": 2}, timeout=30)))
        held.start()
        assert entered.wait(10)
        assert httpx.get(server.base_url.removesuffix("/v1") + "/health", timeout=5).status_code == 200
        release.set()
        held.join(30)
    assert answer[0].status_code == 200, answer[0].text


# ---------------------------------------------------------------------------------------------- types

@pytest.mark.parametrize("path,fields,param", [
    ("/chat/completions", {"model": 5}, "model"),
    ("/chat/completions", {"messages": "hi"}, "messages"),
    ("/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, "messages.[0].role"),
    ("/chat/completions", {"messages": [{"role": "user", "content": 5}]}, "messages.[0].content"),
    ("/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
     "messages.[0].content.[0].text"),
    ("/chat/completions", {"n": "two"}, "n"),
    ("/chat/completions", {"max_tokens": 1.5}, "max_tokens"),
    ("/chat/completions", {"temperature": "hot"}, "temperature"),
    ("/chat/completions", {"stop": 5}, "stop"),
    ("/chat/completions", {"stream": "maybe"}, "stream"),
    ("/chat/completions", {"logprobs": [1]}, "logprobs"),
    ("/chat/completions", {"tools": "x"}, "tools"),
    ("/completions", {"prompt": {"a": 1}}, "prompt"),
    ("/completions", {"prompt": [1, "a"]}, "prompt"),
])
def test_a_field_of_the_wrong_type_is_named(srv, path, fields, param):
    body = {"model": MODEL, **({"messages": USER} if path == "/chat/completions" else {"prompt": "1+1="}),
            "max_tokens": 2, **fields}
    refused(post(srv.url, path, body), param=param)


@pytest.mark.parametrize("missing", ["model", "messages"])
def test_a_missing_field_is_named(srv, missing):
    body = {"model": MODEL, "messages": USER}
    del body[missing]
    refused(post(srv.url, "/chat/completions", body), param=missing, says="required")


# ---------------------------------------------------------------------------------------------- ranges

@pytest.mark.parametrize("fields,param", [
    ({"seed": 2**63}, "seed"),
    ({"seed": -2**63 - 1}, "seed"),
    ({"temperature": -1}, "temperature"),
    ({"temperature": 3}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_k": -2}, "top_k"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": 10**20}, "max_tokens"),
    ({"n": 0}, "n"),
    ({"n": 10**6}, "n"),
    ({"n": MAX_RUNNING + 1}, "n"),  # under the protocol's bound, over what may ever run at once
])
def test_a_value_out_of_range_is_named(srv, fields, param):
    refused(complete(srv.url, **fields), param=param)


def test_not_a_number_is_refused(srv):
    body = b'{"model": "tiny", "messages": [{"role": "user", "content": "x"}], "temperature": NaN}'
    refused(post(srv.url, "/chat/completions", body), param="temperature", says="finite")


def test_the_largest_seed_is_taken(srv):
    assert complete(srv.url, seed=2**63 - 1, temperature=1.0).status_code == 200


@pytest.mark.parametrize("prompt,says", [
    ([-1, 5], "token ids"),
    ([10**6], "token ids"),
    ("", "empty"),
    ([], "no prompt"),
    ([[]], "empty"),
    ([7] * 600, "context"),  # the model's context is 512 tokens
    ("x" * 40_000, "characters"),  # refused by its length before it is tokenized
    (["1+1="] * (MAX_WAITING + 1), "max_waiting"),  # could never wait all at once: not a 429
], ids=["negative-id", "id-over-vocabulary", "empty-text", "no-prompt", "empty-ids", "over-context-tokens",
        "over-context-characters", "more-than-may-wait"])
def test_a_prompt_that_cannot_be_served_is_named(srv, prompt, says):
    refused(post(srv.url, "/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 2}), param="prompt",
            says=says)


def test_a_chat_too_long_for_the_context_is_refused_before_it_is_tokenized(srv):
    messages = [{"role": "user", "content": "7" * 40_000}]
    refused(post(srv.url, "/chat/completions", {"model": MODEL, "messages": messages}), param="messages",
            says="characters")


@pytest.mark.parametrize("fields", [{"temperature": 1e-300}, {"top_p": 1e-300}])
def test_vanishing_sampling_parameters_answer_with_finite_numbers(srv, fields):
    r = complete(srv.url, logprobs=True, max_tokens=4, **fields)
    assert r.status_code == 200 and all(-1e4 < e["logprob"] <= 0 for e in r.json()["choices"][0]["logprobs"]["content"])


# ---------------------------------------------------------------------------------------------- encodings

@pytest.mark.parametrize("path,body,param", [
    ("/chat/completions", b'{"model": "tiny", "messages": [{"role": "user", "content": "a\\ud800b"}]}',
     "messages.[0].content"),
    ("/chat/completions", b'{"model": "tiny", "messages": [{"role": "user", "content": "x"}], "stop": ["\\udc00"]}',
     "stop.[0]"),
    ("/chat/completions", b'{"model": "\\ud83d", "messages": [{"role": "user", "content": "x"}]}', "model"),
    ("/completions", b'{"model": "tiny", "prompt": "1", "logit_bias": {"\\udfff": 1}}', "logit_bias.\udfff"),
], ids=["content", "stop", "model", "key"])
def test_a_lone_surrogate_is_refused_naming_its_field(srv, path, body, param):
    error = refused(post(srv.url, path, body))
    assert error["param"].encode("utf-8", "replace") == param.encode("utf-8", "replace")


@pytest.mark.parametrize("content", ["\\ud83d\\ude00 paired", "nul \\u0000 char", "日本語 ✓"],
                         ids=["surrogate-pair", "nul", "non-latin"])
def test_text_that_is_text_is_answered(srv, content):
    body = f'{{"model": "tiny", "messages": [{{"role": "user", "content": "{content}"}}], "max_tokens": 2}}'
    assert post(srv.url, "/chat/completions", body.encode()).status_code == 200


def test_a_utf8_byte_order_mark_is_read(srv):
    body = b"\xef\xbb\xbf" + json.dumps({"model": MODEL, "messages": USER, "max_tokens": 2}).encode()
    assert post(srv.url, "/chat/completions", body).status_code == 200


# ---------------------------------------------------------------------------------------------- disconnects

def test_a_client_gone_mid_body_leaves_nothing_behind(srv):
    head = (b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            b"content-length: 1000\r\n\r\n{\"model\"")
    with socket.create_connection(("127.0.0.1", srv.port)) as s:
        s.sendall(head)
    assert complete(srv.url).status_code == 200
    wait_for(lambda: idle(srv))


@pytest.mark.parametrize("reset", [False, True])
def test_a_client_gone_mid_stream_has_its_samples_cancelled(srv, reset):
    body = json.dumps({"model": MODEL, "messages": USER, "max_tokens": 400, "temperature": 0, "stream": True,
                       "ignore_eos": True}).encode()
    s = socket.create_connection(("127.0.0.1", srv.port))
    s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
              b"content-length: %d\r\n\r\n%s" % (len(body), body))
    head = b""
    while b"data: " not in head:  # the stream has begun
        head += s.recv(65536)
    if reset:  # an abortive close: the server's next write fails
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
    s.close()
    wait_for(lambda: idle(srv))
    assert complete(srv.url).status_code == 200


def test_a_client_gone_before_its_answer_has_its_samples_cancelled(srv):
    with pytest.raises(httpx.TimeoutException):
        httpx.post(srv.url + "/chat/completions", json={"model": MODEL, "messages": USER, "max_tokens": 400,
                                                        "ignore_eos": True}, timeout=0.3)
    wait_for(lambda: idle(srv))


# ---------------------------------------------------------------------------------------------- slow clients

def test_a_connection_stalled_in_its_headers_is_closed(srv):
    response = raw(srv.port, b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-le")
    assert status_of(response) == 408 and "headers" in json_of(response)["error"]["message"]


def test_a_connection_that_sends_nothing_is_closed(srv):
    assert status_of(raw(srv.port)) == 408


def test_a_body_trickling_in_is_dropped_at_the_deadline(srv):
    """A byte every 0.4 s would take 40 s for this body; the server answers 408 within its read deadline."""
    with socket.create_connection(("127.0.0.1", srv.port), timeout=10) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                  b"content-length: 100\r\n\r\n")
        s.settimeout(0.4)
        response = b""
        for _ in range(100):
            try:
                s.sendall(b" ")
                response += s.recv(65536)
            except socket.timeout:
                continue
            except OSError:  # closed by the server
                break
            if response.endswith(b"}"):
                break
    assert status_of(response) == 408 and json_of(response)["error"]["code"] == "request_timeout"


def test_an_idle_kept_alive_connection_is_closed(srv):
    with socket.create_connection(("127.0.0.1", srv.port), timeout=10) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
        response = b""
        while not response.endswith(b"}"):
            response += s.recv(65536)
        assert response.startswith(b"HTTP/1.1 200")
        assert s.recv(65536) == b""  # closed after the keep-alive timeout, nothing more sent


def test_headers_without_end_are_refused_at_the_limit(srv):
    response = raw(srv.port, b"GET /health HTTP/1.1\r\nhost: x\r\nx-big: " + b"a" * 20_000)  # and no end
    assert status_of(response) == 400 and "headers" in json_of(response)["error"]["message"]


def test_a_request_that_is_not_http_is_refused(srv):
    response = raw(srv.port, b"HELLO THERE\r\n\r\n")
    assert status_of(response) == 400 and json_of(response)["error"]["type"] == "invalid_request_error"


def test_connections_over_the_limit_are_answered_503(srv):
    sockets = []
    try:
        for _ in range(LIMITS.max_connections + 5):
            sockets.append(socket.create_connection(("127.0.0.1", srv.port), timeout=5))
        answered = []
        for s in sockets[-5:]:  # the last ones are over the limit: answered and closed at once
            s.settimeout(5)
            answered.append(s.recv(65536))
        assert all(status_of(a) == 503 and json_of(a)["error"]["type"] == "server_error" for a in answered)
    finally:
        for s in sockets:
            s.close()
    wait_for(lambda: complete(srv.url).status_code == 200)


def test_a_stream_read_slowly_does_not_hold_up_other_clients(srv):
    c = client(srv.url)
    stream = c.chat.completions.create(model=MODEL, messages=USER, max_tokens=200, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    chunks = iter(stream)
    first = next(chunks)
    assert c.chat.completions.create(model=MODEL, messages=USER, max_tokens=2).choices  # meanwhile
    rest = list(chunks)
    assert first.choices[0].delta.role == "assistant" and rest[-1].choices[0].finish_reason == "length"


# ---------------------------------------------------------------------------------------------- SIGTERM

def test_sigterm_fails_every_request_in_flight_as_an_openai_error(tmp_path):
    """`posttrain serve` on SIGTERM (no grace): the stream decoding gets an error event and [DONE], the requests
    waiting behind it (--max-running 1) a 503 error body, streamed or not; the process exits 0."""
    from posttrain.data.synthetic_tools import tokenizer_corpus
    from posttrain.models.tiny import build_tiny_model

    model = build_tiny_model(tmp_path / "m", tokenizer_corpus(0, 300), hidden_size=64, num_layers=2, num_heads=4,
                             num_kv_heads=2, intermediate_size=128, seed=0, tools=True, max_position_embeddings=4096)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "posttrain", "serve", str(model), "--port", "0",
                             "--served-model-name", MODEL, "--device", "cpu", "--max-running", "1",
                             "--shutdown-grace-s", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        line = proc.stdout.readline()
        assert " at http://" in line, line + proc.stderr.read()
        url = line.split(" at ")[1].strip()
        long = {"model": MODEL, "messages": USER, "max_tokens": 4000, "temperature": 0, "ignore_eos": True}
        errors = []

        def waiting(stream: bool):
            try:
                out = client(url).chat.completions.create(model=MODEL, messages=USER, max_tokens=4000, stream=stream,
                                                          extra_body={"ignore_eos": True})
                list(out) if stream else None
            except openai.APIStatusError as e:
                errors.append((stream, e.status_code, e.body))
        with httpx.stream("POST", url + "/chat/completions", json={**long, "stream": True}, timeout=60) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")
            threads = [threading.Thread(target=waiting, args=(stream,)) for stream in (False, True)]
            for t in threads:
                t.start()
            health = url.removesuffix("/v1") + "/health"
            wait_for(lambda: httpx.get(health).json()["stats"]["requests_waiting"] == 2, 60)
            proc.send_signal(signal.SIGTERM)
            rest = [x for x in lines if x]
        for t in threads:
            t.join(30)
        error = json.loads(rest[-2].removeprefix("data: "))["error"]
        assert rest[-1] == "data: [DONE]" and error["code"] == "server_shutting_down"
        assert sorted(errors, key=str) == [(False, 503, error), (True, 503, error)]
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate()


# ---------------------------------------------------------------------------------------------- memory

def test_the_servers_memory_is_where_it_was_after_all_this(srv):
    assert complete(srv.url).status_code == 200
    wait_for(lambda: idle(srv))
    grown = rss_mb() - srv.rss_before
    print(f"server process RSS: {srv.rss_before:.0f} MB before the suite, {rss_mb():.0f} MB after")
    assert grown < 100, f"the server's resident memory grew {grown:.0f} MB over the suite"
