"""The search tool over a retrieval server, as verl's search tool calls one: a tiny local server answering as verl's
retrieval server does (`examples/sglang_multiturn/search_r1_like/local_dense_retriever/retrieval_server.py`) gets
verl's request, and the tool's text is verl's formatting (`verl/tools/utils/search_r1_like_utils.py`); a server that is
down, slow, dripping, failing, or answering garbage or a huge body ends the call as a counted tool error with a
message to the model; the tool's keys are checked at load."""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from posttrain.tools import ToolBox, ToolCall
from posttrain.tools.builtin.retrieval import RetrievalError, format_results
from posttrain.tools.builtin.search import SearchTool, config_problem

CORPUS = ["Paris\nParis is the capital of France.\nIt lies on the Seine.",
          "Berlin\nBerlin is the capital of Germany.",
          "Okapi\nThe okapi is a mammal.",
          "Zürich\nZürich liegt am Zürichsee."]


class Retriever(BaseHTTPRequestHandler):
    """verl's retrieval server in miniature: POST {"queries", "topk", "return_scores"} -> {"result": [[{"document":
    {"id", "contents"}, "score"}, ...] per query]}, the k documents sharing most words with the query (as a dense
    retriever, always k). `server.script` lists what to do for the next requests instead ("ok" when empty)."""

    def log_message(self, *args):
        pass

    def do_POST(self):
        server = self.server
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with server.lock:
            server.requests.append((dict(self.headers), body))
            server.in_flight += 1
            server.most_in_flight = max(server.most_in_flight, server.in_flight)
            action = server.script.pop(0) if server.script else ("ok",)
        try:
            self.act(action, body)
        finally:
            with server.lock:
                server.in_flight -= 1

    def act(self, action, body):
        kind = action[0]
        if kind in ("ok", "slow", "pair"):
            if kind == "slow":
                time.sleep(action[1])
            if kind == "pair":  # answers once two requests are in flight together
                self.server.pair.wait(timeout=5)
            result = []
            for query in body["queries"]:
                words = set(query.lower().split())
                ranked = sorted(range(len(CORPUS)), key=lambda i: -len(words & set(CORPUS[i].lower().split())))
                result.append([{"document": {"id": str(i), "contents": CORPUS[i]},
                                "score": float(len(words & set(CORPUS[i].lower().split())))}
                               for i in ranked[:body["topk"]]])
            self.send(200, json.dumps({"result": result}).encode())
        elif kind == "status":
            self.send(action[1], b'{"detail": "no"}')
        elif kind == "body":
            self.send(200, action[1])
        elif kind == "stall":  # no answer until the test ends
            self.server.release.wait(timeout=10)
        elif kind == "huge":  # n bytes, with or without a Content-Length
            n, with_length = action[1], action[2]
            self.send_response(200)
            if with_length:
                self.send_header("Content-Length", str(n))
            self.end_headers()
            for _ in range(n // 1000):
                self.wfile.write(b" " * 1000)
        elif kind == "drip":  # a byte at a time, never finishing before the test ends
            self.send_response(200)
            self.send_header("Content-Length", "10000")
            self.end_headers()
            while not self.server.release.wait(timeout=0.1):
                self.wfile.write(b" ")
                self.wfile.flush()

    def send(self, status, body: bytes):
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@contextlib.contextmanager
def retrieval_server():
    """A `Retriever` on a free local port, its URL as `.url`, what it was sent in `.requests`."""
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Retriever)
    httpd.daemon_threads = True
    httpd.handle_error = lambda *args: None  # a client that hung up mid-answer (the huge bodies) is expected
    httpd.lock, httpd.requests, httpd.script = threading.Lock(), [], []
    httpd.in_flight = httpd.most_in_flight = 0
    httpd.release, httpd.pair = threading.Event(), threading.Barrier(2)
    httpd.url = f"http://127.0.0.1:{httpd.server_address[1]}/retrieve"
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield httpd
    finally:
        httpd.release.set()
        httpd.shutdown()
        httpd.server_close()


@pytest.fixture
def server():
    with retrieval_server() as httpd:
        yield httpd


def search_tool(url, **config):
    return SearchTool({"retrieval_service_url": url, "type": "native", **config})


def run_call(tool, queries):
    """One call through an episode's tool session, as the agent loop makes it."""
    box = ToolBox([tool], max_tool_response_length=4000, timeout_s=30)
    return box.open().run([ToolCall("search", {"query_list": queries}, raw="")])[0]


def test_verls_request_and_result_text(server):
    """The request is verl's (JSON body, headers, `topk` from the YAML, scores asked for); the text is verl's
    `_passages2string` per query (first line the title, the rest the text), joined by "\\n---\\n", as JSON with
    non-ASCII kept."""
    tool = search_tool(server.url, topk=2, timeout=10, num_workers=4, rate_limit=4)
    result = run_call(tool, ["capital France", "Zürich liegt okapi"])
    assert result.error is None
    expected = ("Doc 1 (Title: Paris)\nParis is the capital of France.\nIt lies on the Seine.\n\n"
                "Doc 2 (Title: Berlin)\nBerlin is the capital of Germany.\n---\n"
                "Doc 1 (Title: Zürich)\nZürich liegt am Zürichsee.\n\n"
                "Doc 2 (Title: Okapi)\nThe okapi is a mammal.")
    assert result.message["content"] == '{"result": ' + json.dumps(expected, ensure_ascii=False) + "}"
    assert result.metrics == {"query_count": 2, "total_results": 4}
    (headers, body), = server.requests
    assert body == {"queries": ["capital France", "Zürich liegt okapi"], "topk": 2, "return_scores": True}
    assert headers["Content-Type"] == "application/json" and headers["Accept"] == "application/json"


def test_verls_formatting_of_edge_cases():
    """A document of one line is a title with an empty text; a query without results gives an empty block; an empty
    `result` is "No search results found." (verl's texts)."""
    answer = {"result": [[], [{"document": {"contents": "Only a title"}, "score": 1.0}]]}
    assert format_results(answer, 2) == ("\n---\nDoc 1 (Title: Only a title)", 1)
    assert format_results({"result": []}, 1) == ("No search results found.", 0)


def test_a_failing_server_call_is_retried_as_verl_retries(server):
    """HTTP 503 is retried (after 1 s, as verl waits); HTTP 422 is not: it is the call's error."""
    server.script = [("status", 503)]
    assert run_call(search_tool(server.url, timeout=10), ["okapi"]).error is None
    assert len(server.requests) == 2
    server.script = [("status", 422)]
    result = run_call(search_tool(server.url, timeout=10), ["okapi"])
    assert result.error == "tool_raised" and "answered HTTP 422" in result.message["content"]
    assert len(server.requests) == 3


@pytest.mark.parametrize("action, message", [
    (("body", b"<html>502 Bad Gateway</html>"), "answered with something that is not JSON: '<html>502"),
    (("body", b'{"hits": []}'), "answer has no `result` list"),
    (("body", b'{"result": [["Paris"]]}'), "a result that is not {\"document\": {\"contents\""),
    (("body", b'{"result": [[], []]}'), "answer has 2 result list(s) for 1 queries"),
    (("huge", 50_000, True), "an answer of more than 10000 bytes (the tool's max_response_bytes)"),
    (("huge", 50_000, False), "an answer of more than 10000 bytes (the tool's max_response_bytes)"),
    (("stall",), "gave no answer in 1 attempt(s) within 0.5 s (the tool's timeout); last: no answer in time"),
    (("drip",), "did not finish its answer within 0.5 s"),
], ids=["not_json", "no_result", "wrong_layout", "wrong_count", "huge_with_length", "huge_streamed", "stall",
        "drip"])
def test_a_bad_answer_is_a_counted_tool_error(server, action, message):
    """Garbage, a huge body, no answer in time: the call ends (within its timeout) as `tool_raised`, the session's
    counted kind, with a message the model reads; nothing raises out of the session."""
    server.script = [action]
    result = run_call(search_tool(server.url, timeout=0.5, max_response_bytes=10_000), ["okapi"])
    assert result.error == "tool_raised"
    assert result.message["content"].startswith("Error: tool 'search' failed: RetrievalError: the retrieval server")
    assert message in result.message["content"], result.message["content"]


def test_a_server_that_is_down_is_a_counted_tool_error():
    """Connections refused are retried (verl's waits) until the timeout, then the call's error names the server."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    url = f"http://127.0.0.1:{port}/retrieve"
    result = run_call(search_tool(url, timeout=1.5), ["okapi"])
    assert result.error == "tool_raised"
    assert f"the retrieval server at {url} gave no answer in 2 attempt(s) within 1.5 s" in result.message["content"]
    assert "cannot connect" in result.message["content"]
    with pytest.raises(RetrievalError):
        search_tool(url, timeout=0.1).execute("i", {"query_list": ["okapi"]})


def test_num_workers_and_rate_limit_bound_the_requests_in_flight(server):
    """At most min(num_workers, rate_limit) requests at once (num_workers alone without the global rate limit)."""
    def together(tool):
        results = [None, None]
        threads = [threading.Thread(target=lambda i=i: results.__setitem__(i, run_call(tool, ["okapi"])))
                   for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return results

    server.script = [("slow", 0.2), ("slow", 0.2)]
    assert all(r.error is None for r in together(search_tool(server.url, num_workers=4, rate_limit=1)))
    assert server.most_in_flight == 1
    server.script = [("pair",), ("pair",)]  # each answers only with the other in flight
    unlimited = search_tool(server.url, num_workers=2, rate_limit=1, enable_global_rate_limit=False)
    assert all(r.error is None for r in together(unlimited))
    assert server.most_in_flight == 2


@pytest.mark.parametrize("config, message", [
    ({}, "set exactly one of config.retrieval_service_url"),
    ({"retrieval_service_url": "http://127.0.0.1:8000/retrieve", "corpus_path": "c.jsonl"}, "got both"),
    ({"corpus_path": "c.jsonl", "timeout": 30}, "timeout apply to a retrieval server, not to corpus_path"),
    ({"retrieval_service_url": "http://127.0.0.1:8000/retrieve", "retrival_topk": 3},
     "config key(s) ['retrival_topk'] are not read by the search tool"),
    ({"retrieval_service_url": "127.0.0.1:8000/retrieve"}, "is not an http:// or https:// URL"),
    ({"retrieval_service_url": "http://127.0.0.1:8000/retrieve", "timeout": 0},
     "config.timeout=0 must be a positive number"),
    ({"retrieval_service_url": "http://127.0.0.1:8000/retrieve", "rate_limit": "many"}, "config.rate_limit='many'"),
])
def test_the_tools_settings_are_checked_at_load(config, message):
    assert message in config_problem(config)
    with pytest.raises(ValueError, match="the search tool: "):
        SearchTool(config)
