"""Running the app: `serve_in_thread` (uvicorn in a thread of this process: training and tests), `run` (the same
until SIGINT / SIGTERM) and `serve_engine` (`posttrain serve`: scheduler, app and `run` over a decoding engine).

The HTTP server's own limits (limits.py): uvicorn's keep-alive timeout and header size, and a protocol class that
gives each request's headers a deadline and bounds the open connections.
"""

from __future__ import annotations

import signal
import threading
import time

try:
    import uvicorn
except ImportError as e:  # the serve extra is optional
    raise ImportError("the server needs FastAPI and uvicorn: pip install 'posttrain[serve]'") from e

from .limits import Limits, guarded_protocol

STARTUP_TIMEOUT_S = 30.0
ANSWER_S = 5.0  # after the scheduler closes, the time its requests' error answers have to go out


class ServerThread:
    """A uvicorn server in a daemon thread. `base_url` is the OpenAI base URL (http://HOST:PORT/v1). `graceful_s`:
    on `close`, how long requests in flight may take to finish before they are cut."""

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, limits: Limits = Limits(),
                 graceful_s: float = 1.0):
        config = uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False,
                                timeout_graceful_shutdown=graceful_s, lifespan="off", http=guarded_protocol(limits),
                                timeout_keep_alive=limits.keep_alive_s,
                                h11_max_incomplete_event_size=limits.max_header_bytes)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, name="posttrain-serve", daemon=True)
        self.thread.start()
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the server did not start on {host}:{port} (is the port taken?)")
            time.sleep(0.01)
        self.host = host
        self.port = self.server.servers[0].sockets[0].getsockname()[1]

    @property
    def base_url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/v1"

    def stop_accepting(self) -> None:
        """No new connection or request; the requests in flight go on (up to `graceful_s`)."""
        self.server.should_exit = True

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=self.server.config.timeout_graceful_shutdown + 10)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def serve_in_thread(app, host: str = "127.0.0.1", port: int = 0, limits: Limits = Limits(),
                    graceful_s: float = 1.0) -> ServerThread:
    """`app` served from a thread; returns once it accepts connections (port 0: a free port)."""
    return ServerThread(app, host, port, limits, graceful_s)


def serve_engine(engine, tokenizer, name: str, *, host: str = "127.0.0.1", port: int = 8000,
                 api_key: str | None = None, max_running: int = 64, max_waiting: int = 256,
                 prefix_cache_tokens: int = 32768, request_timeout_s: float = 600, limits: Limits = Limits(),
                 shutdown_grace_s: float = 5.0, on_ready=print) -> None:
    """`posttrain serve`: a scheduler over `engine` (a DecodeEngine) and the app over it, served until interrupted."""
    from .app import Served, build_app
    from .scheduler import Scheduler

    scheduler = Scheduler(engine, max_running=max_running, max_waiting=max_waiting,
                          prefix_cache_tokens=prefix_cache_tokens)
    scheduler.start()
    try:
        app = build_app(Served(name, tokenizer, scheduler), api_key=api_key, request_timeout_s=request_timeout_s,
                        limits=limits)
        run(app, host, port, on_ready, on_stop=scheduler.close, limits=limits, grace_s=shutdown_grace_s)
    finally:
        scheduler.close()


def run(app, host: str, port: int, on_ready=print, on_stop=None, limits: Limits = Limits(),
        grace_s: float = 5.0) -> None:
    """Serve until SIGINT or SIGTERM; `on_ready(base_url)` once it accepts connections. On the signal no new
    request is taken, those in flight have `grace_s` to finish (a second signal ends it), then `on_stop()` (the
    scheduler's close: every request left fails as an OpenAI error, 503 or a stream's error event and [DONE]) and
    their answers go out."""
    stop = threading.Event()
    previous = {s: signal.signal(s, lambda *_: stop.set()) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        with serve_in_thread(app, host, port, limits, graceful_s=grace_s + ANSWER_S) as server:
            on_ready(server.base_url)
            while not stop.is_set() and server.thread.is_alive():
                stop.wait(0.5)
            stop.clear()
            server.stop_accepting()
            deadline = time.monotonic() + grace_s
            while server.thread.is_alive() and not stop.is_set() and time.monotonic() < deadline:
                stop.wait(0.05)  # the thread ends once every request in flight has been answered
            if on_stop is not None:
                on_stop()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
