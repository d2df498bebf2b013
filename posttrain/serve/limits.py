"""What the server lets in, before a request reaches the API: the key, the body's size and reading time, and the
connection's wait for its headers. A client that sends too much, too slowly or nothing at all costs the server a
bounded amount of memory and time, and every refusal is an OpenAI error body.

- `KeyCheck` (ASGI): `/v1/...` and `/rl/...` need `Authorization: Bearer <key>`.
- `BodyLimits` (ASGI): a request's body is read whole, within `max_body_bytes` (else 413, refused from its
  Content-Length before any of it is read) and within `read_timeout_s` of its headers (else 408: a body trickling in
  a byte at a time is dropped), before the app parses it; a JSON string with a lone surrogate escape (`"\\ud800"`,
  which no UTF-8 text can hold) is refused with a 400 naming its field.
- `guarded_protocol`: uvicorn's h11 connection with a deadline for the request line and headers (h11 waits for them
  forever: a connection stalled in its headers is closed with a 408 after `read_timeout_s`) and a bound on open
  connections (one more is answered 503 and closed).
"""

from __future__ import annotations

import asyncio
import json
import re
import resource
import secrets
from dataclasses import dataclass

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from .protocol import error_body

_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")  # a surrogate's escape (paired or not): looked at closer


@dataclass(frozen=True)
class Limits:
    """The server's bounds on what clients send (docs/serve.md, "Limits")."""
    max_body_bytes: int = 16 * 2**20  # a larger body is refused with 413
    read_timeout_s: float = 30.0  # headers within it of the connection's turn; then the body within it
    keep_alive_s: float = 5.0  # an idle kept-alive connection is closed after it (uvicorn's timeout_keep_alive)
    max_header_bytes: int = 64 * 1024  # request line + headers (h11's max incomplete event size)
    max_connections: int | None = None  # open connections; None: the file descriptor limit less a margin

    def connections(self) -> int:
        if self.max_connections is not None:
            return self.max_connections
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        return 4096 if soft == resource.RLIM_INFINITY else max(16, min(4096, soft - 128))


async def _answer(send, status: int, message: str, kind: str = "invalid_request_error", code: str | None = None,
                  param: str | None = None) -> None:
    """An OpenAI error response that closes the connection (its request's body may not have been read)."""
    body = json.dumps(error_body(message, kind, code, param)).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": body})


class KeyCheck:
    """`/v1/...` and `/rl/...` need `Authorization: Bearer <api_key>` (checked before the body is read, so a request
    without the key learns nothing else); `/health` does not."""

    def __init__(self, app, api_key: str):
        self.app, self.expected = app, f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith(("/v1/", "/rl/")):
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not secrets.compare_digest(given, self.expected):
                await _answer(send, 401, "a wrong or missing API key (Authorization: Bearer KEY)",
                              code="invalid_api_key")
                return
        await self.app(scope, receive, send)


def lone_surrogate(value, path: str = "") -> str | None:
    """The path (OpenAI's `messages.[0].content`) of the first string or key of parsed JSON `value` holding a lone
    surrogate (None: none does)."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path or "body"
        return None
    if isinstance(value, dict):
        for key, item in value.items():
            where = f"{path}.{key}" if path else str(key)
            found = lone_surrogate(key, where) or lone_surrogate(item, where)
            if found:
                return found
    elif isinstance(value, list):
        for i, item in enumerate(value):
            found = lone_surrogate(item, f"{path}.[{i}]" if path else f"[{i}]")
            if found:
                return found
    return None


class BodyLimits:
    """A POST's body read whole before the app sees it: at most `max_body_bytes` (413), within `timeout_s` of its
    headers (408), without a lone surrogate in a JSON string (400); then handed to the app as one message."""

    def __init__(self, app, max_body_bytes: int, timeout_s: float):
        self.app, self.max_bytes, self.timeout_s = app, max_body_bytes, timeout_s

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] not in ("POST", "PUT", "PATCH"):
            await self.app(scope, receive, send)
            return
        too_big = f"the request body is over the server's limit of {self.max_bytes} bytes"
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            await _answer(send, 413, too_big, code="request_too_large")
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout_s
        chunks, size, more = [], 0, True
        while more:
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - loop.time()))
            except asyncio.TimeoutError:
                await _answer(send, 408, f"the request body did not arrive within {self.timeout_s:g} s",
                              code="request_timeout")
                return
            if message["type"] == "http.disconnect":  # the client went away: nobody to answer
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                await _answer(send, 413, too_big, code="request_too_large")
                return
            chunks.append(chunk)
            more = message.get("more_body", False)
        body = b"".join(chunks)
        del chunks
        if _SURROGATE_ESCAPE.search(body):
            try:
                where = lone_surrogate(json.loads(body))
            except (ValueError, RecursionError):  # not JSON: the app says so
                where = None
            if where is not None:
                await _answer(send, 400, f"{where}: the string holds a lone surrogate escape (\\ud800-\\udfff "
                                         f"without its pair), which is not text", param=where)
                return
        replayed = False

        async def replay():
            nonlocal replayed
            if replayed:  # after the body: the connection's own messages (a disconnect)
                return await receive()
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)


def guarded_protocol(limits: Limits) -> type:
    """uvicorn's h11 protocol class with a deadline for each request's line and headers (from the connection's
    opening, or the previous response's end, to the end of its headers) and the bound on open connections."""
    most = limits.connections()

    class GuardedH11Protocol(H11Protocol):
        _header_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport):
            super().connection_made(transport)
            if len(self.connections) > most:
                self._refuse(503, f"the server has {most} connections open, its limit; retry later", "server_error")
                return
            self._arm()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self.conn.their_state is not h11.IDLE:  # the headers are in (the body has its own deadline)
                self._disarm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing() and self.conn.their_state is h11.IDLE:
                self._arm()

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

        def send_400_response(self, msg: str) -> None:  # h11 could not parse the request: an OpenAI error as well
            body = json.dumps(error_body(f"not a valid HTTP/1.1 request, or its line and headers are over "
                                         f"{limits.max_header_bytes} bytes", "invalid_request_error")).encode()
            headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                       (b"connection", b"close")]
            for event in (h11.Response(status_code=400, headers=headers, reason=b"Bad Request"), h11.Data(data=body),
                          h11.EndOfMessage()):
                self.transport.write(self.conn.send(event))
            self.transport.close()

        def _arm(self) -> None:
            self._disarm()
            self._header_timer = self.loop.call_later(limits.read_timeout_s, self._headers_late)

        def _disarm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _headers_late(self) -> None:
            self._header_timer = None
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                self._refuse(408, f"the request's headers did not arrive within {limits.read_timeout_s:g} s")

        def _refuse(self, status: int, message: str, kind: str = "invalid_request_error") -> None:
            """A whole response written as bytes (h11 sends none before a request) and the connection closed."""
            body = json.dumps(error_body(message, kind)).encode()
            head = (f"HTTP/1.1 {status} {_PHRASES[status]}\r\n"
                    f"content-type: application/json\r\ncontent-length: {len(body)}\r\nconnection: close\r\n\r\n")
            self.transport.write(head.encode() + body)
            self.transport.close()

    return GuardedH11Protocol


_PHRASES = {408: "Request Timeout", 503: "Service Unavailable"}
