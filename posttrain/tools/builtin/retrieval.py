"""A client of the retrieval server verl's search tool calls (the Search-R1 `retrieval_server.py` and servers built
like it): verl's request, retries and result text (`verl/tools/utils/search_r1_like_utils.py`), so a server that
serves verl serves posttrain unchanged.

Request: POST `{"queries": [...], "topk": k, "return_scores": true}` as JSON. Answer: `{"result": [[{"document":
{"contents": "<title>\\n<text>", ...}, "score": s}, ...], ...]}`, one list per query. Retried as verl retries: a
refused or dropped connection, no answer in time, HTTP 500/502/503/504, up to 10 attempts, waiting 1 s, 2 s, 3 s, ...
between them. Unlike verl, `timeout_s` bounds the whole call (attempts and waits; a read that stalls past it ends at
the socket's timeout), and the answer's size is bounded, so that a down, slow or flooding server ends the call within
its episode's tool time. Every failure raises `RetrievalError`: the episode's tool session answers the model with its
message and counts it (`agent/tool_errors/tool_raised`); verl writes such failures into the result text instead.
"""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time
import urllib.error
import urllib.request

MAX_ATTEMPTS = 10  # verl's MAX_RETRIES
RETRY_STATUSES = (500, 502, 503, 504)
CHUNK = 1 << 16


class RetrievalError(RuntimeError):
    """The retrieval server gave no usable answer."""


class _Retry(Exception):
    """A failure verl retries."""


class RetrievalClient:
    """One per tool: at most `concurrency` requests in flight at once (verl's `num_workers` / `rate_limit`)."""

    def __init__(self, url: str, *, timeout_s: float, max_response_bytes: int, concurrency: int):
        self.url, self.timeout_s, self.max_response_bytes = url, timeout_s, max_response_bytes
        self.concurrency = concurrency
        self._slots = threading.BoundedSemaphore(concurrency)

    def search(self, queries: list[str], topk: int) -> tuple[str, int]:
        """verl's result text for the queries (before its JSON wrapping) and the number of documents found."""
        deadline = time.monotonic() + self.timeout_s
        if not self._slots.acquire(timeout=self.timeout_s):
            raise RetrievalError(f"{self.concurrency} searches were already in flight to {self.url} for "
                                 f"{self.timeout_s:g} s (the tool's num_workers / rate_limit)")
        try:
            answer = self._post(json.dumps({"queries": queries, "topk": topk, "return_scores": True}).encode(),
                                deadline)
        finally:
            self._slots.release()
        return format_results(answer, len(queries))

    def _post(self, body: bytes, deadline: float):
        """The decoded JSON answer, retried as verl retries until `deadline`."""
        last = ""
        for attempt in range(1, MAX_ATTEMPTS + 1):
            try:
                return self._post_once(body, deadline)
            except _Retry as e:
                last = str(e)
            wait = float(attempt)  # verl: INITIAL_RETRY_DELAY * (attempt + 1), counted from 1 s
            if attempt == MAX_ATTEMPTS or time.monotonic() + wait >= deadline:
                break
            time.sleep(wait)
        raise RetrievalError(f"the retrieval server at {self.url} gave no answer in {attempt} attempt(s) within "
                             f"{self.timeout_s:g} s (the tool's timeout); last: {last}")

    def _post_once(self, body: bytes, deadline: float):
        request = urllib.request.Request(self.url, data=body, method="POST", headers={
            "Content-Type": "application/json", "Accept": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=max(deadline - time.monotonic(), 0.001)) as response:
                raw = self._read(response, deadline)
        except urllib.error.HTTPError as e:
            if e.code in RETRY_STATUSES:
                raise _Retry(f"HTTP {e.code} {e.reason}") from None
            detail = e.read(300).decode("utf-8", "replace") if e.fp is not None else ""
            raise RetrievalError(f"the retrieval server at {self.url} answered HTTP {e.code} {e.reason}: "
                                 f"{detail!r}") from None
        except (TimeoutError, socket.timeout):
            raise _Retry("no answer in time") from None
        except urllib.error.URLError as e:
            if isinstance(e.reason, (TimeoutError, socket.timeout)):
                raise _Retry("no answer in time") from None
            raise _Retry(f"cannot connect: {e.reason}") from None
        except (ConnectionError, http.client.RemoteDisconnected) as e:
            raise _Retry(f"the connection failed: {type(e).__name__}: {e}") from None
        except (http.client.HTTPException, OSError) as e:
            raise RetrievalError(f"the retrieval server at {self.url} broke the HTTP exchange: "
                                 f"{type(e).__name__}: {e}") from None
        try:
            return json.loads(raw)
        except ValueError:
            raise RetrievalError(f"the retrieval server at {self.url} answered with something that is not JSON: "
                                 f"{raw[:200].decode('utf-8', 'replace')!r}") from None

    def _read(self, response, deadline: float) -> bytes:
        """The body, refused past `max_response_bytes` (by its Content-Length, or as it arrives) or past the
        deadline."""
        limit = self.max_response_bytes
        too_big = RetrievalError(f"the retrieval server at {self.url} sent an answer of more than {limit} bytes "
                                 "(the tool's max_response_bytes)")
        length = response.headers.get("Content-Length")
        if length is not None and length.strip().isdigit() and int(length) > limit:
            raise too_big
        chunks, size = [], 0
        while chunk := response.read1(min(CHUNK, limit + 1 - size)):  # returns as data arrives: time is checked
            chunks.append(chunk)
            size += len(chunk)
            if size > limit:
                raise too_big
            if time.monotonic() > deadline:
                raise RetrievalError(f"the retrieval server at {self.url} did not finish its answer within "
                                     f"{self.timeout_s:g} s (the tool's timeout)")
        return b"".join(chunks)


def format_results(answer, n_queries: int) -> tuple[str, int]:
    """verl's text: per query "Doc 1 (Title: <first line>)\\n<other lines>\\n\\nDoc 2 ..." (stripped), the queries
    joined by "\\n---\\n"; "No search results found." for an empty `result`. A layout other than verl's server's is an
    error naming what is wrong."""
    results = answer.get("result") if isinstance(answer, dict) else None
    if not isinstance(results, list):
        raise RetrievalError(f"the retrieval server's answer has no `result` list: {_short(answer)}")
    if not results:
        return "No search results found.", 0
    if len(results) != n_queries:
        raise RetrievalError(f"the retrieval server's answer has {len(results)} result list(s) for {n_queries} "
                             "queries")
    blocks, found = [], 0
    for per_query in results:
        if not isinstance(per_query, list):
            raise RetrievalError("the retrieval server's answer has a query's results that are not a list: "
                                 f"{_short(per_query)}")
        text = ""
        for k, item in enumerate(per_query, 1):
            document = item.get("document") if isinstance(item, dict) else None
            contents = document.get("contents") if isinstance(document, dict) else None
            if not isinstance(contents, str):
                raise RetrievalError("the retrieval server's answer has a result that is not {\"document\": "
                                     '{"contents": "<title>\\n<text>"}, "score": ...} (verl\'s layout with '
                                     f"return_scores): {_short(item)}")
            title, _, body = contents.partition("\n")
            text += f"Doc {k} (Title: {title})\n{body}\n\n"
        blocks.append(text.strip())
        found += len(per_query)
    return "\n---\n".join(blocks), found


def _short(value) -> str:
    return repr(value)[:200]
