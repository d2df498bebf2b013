"""`posttrain sandbox-server`: the local bubblewrap sandbox behind SandboxFusion's HTTP API.

POST /run_code {"code", "language", "run_timeout", "memory_limit_MB", "stdin"} ->
{"status": "Success" | "Failed" | "SandboxError", "message", "compile_result": null,
 "run_result": {"status", "stdout", "stderr", "return_code", "execution_time"}, "files": {}}
`Success` means the program finished with return code 0, `Failed` anything else it did (a non-zero exit, a time
limit, a limit it broke); `SandboxError` (HTTP 400/500) that it could not be run. Run it on a machine apart from
training and point `reward_model.sandbox_fusion.url` at it.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from .sandbox import LANGUAGES, Limits, RunResult, SandboxUnavailable, run_program, sandbox_status

MAX_BODY = 16 << 20


def response_for(result: RunResult) -> dict:
    run = {"status": result.status, "execution_time": result.execution_time, "return_code": result.return_code,
           "stdout": result.stdout, "stderr": result.stderr}
    return {"status": "Success" if result.ok else "Failed", "message": result.reason, "compile_result": None,
            "run_result": run, "files": {}}


class SandboxServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, address, *, max_workers: int = 4, max_timeout: float = 60.0, default_memory_mb: int = 1024,
                 allow_unsandboxed: bool = False):
        super().__init__(address, _Handler)
        self.gate = threading.BoundedSemaphore(max_workers)
        self.max_timeout, self.default_memory_mb = max_timeout, default_memory_mb
        self.allow_unsandboxed = allow_unsandboxed


def _error(message: str) -> dict:
    return {"status": "SandboxError", "message": message, "compile_result": None, "run_result": None, "files": {}}


class _Handler(BaseHTTPRequestHandler):
    server: SandboxServer

    def log_message(self, format, *args):  # one line per request on stderr is noise for a reward server
        pass

    def _send(self, code: int, payload: dict) -> None:
        body = json.dumps(payload).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        if self.path.rstrip("/") in ("", "/v1/ping"):
            usable, why = sandbox_status()
            self._send(200, {"status": "ok" if usable else "no sandbox", "message": why})
        else:
            self._send(404, _error(f"no such path {self.path}; POST /run_code"))

    def do_POST(self):
        if self.path.rstrip("/") != "/run_code":
            return self._send(404, _error(f"no such path {self.path}; POST /run_code"))
        length = int(self.headers.get("Content-Length") or 0)
        if length <= 0 or length > MAX_BODY:
            return self._send(400, _error(f"request body must be 1..{MAX_BODY} bytes of JSON"))
        try:
            req = json.loads(self.rfile.read(length))
            code, language = req["code"], req.get("language", "python")
            if not isinstance(code, str) or not isinstance(language, str):
                raise TypeError("'code' and 'language' must be strings")
            if language.lower() not in LANGUAGES:
                raise ValueError(f"unknown language {language!r}; this server runs {sorted(LANGUAGES)}")
            timeout = float(req.get("run_timeout") or 10.0)
            memory = int(req.get("memory_limit_MB") or -1)
            limits = Limits(wall_s=min(max(timeout, 0.1), self.server.max_timeout),
                            memory_mb=memory if memory > 0 else self.server.default_memory_mb)
            stdin = req.get("stdin") or ""
            if not isinstance(stdin, str):
                raise TypeError("'stdin' must be a string")
            if req.get("files") or req.get("fetch_files"):
                raise ValueError("'files' and 'fetch_files' are not supported by this server: put what the program "
                                 "needs in its code or stdin")
        except (ValueError, TypeError, KeyError) as e:
            return self._send(400, _error(f"bad request: {e}"))
        try:
            with self.server.gate:
                result = run_program(code, language, stdin, limits, allow_unsandboxed=self.server.allow_unsandboxed)
        except SandboxUnavailable as e:
            return self._send(500, _error(str(e)))
        self._send(200, response_for(result))


def serve(host: str = "127.0.0.1", port: int = 8080, *, max_workers: int = 4, allow_unsandboxed: bool = False) -> None:
    """Serve until interrupted; refuses to start where no sandbox can run (unless allowed)."""
    import sys

    from .sandbox import _refusal

    usable, why = sandbox_status()
    if not usable and not allow_unsandboxed:
        raise SandboxUnavailable(_refusal(why).replace("reward_model.code_sandbox.allow_unsandboxed=True",
                                                       "--allow-unsandboxed"))
    server = SandboxServer((host, port), max_workers=max_workers, allow_unsandboxed=allow_unsandboxed)
    mode = why if usable else "UNSANDBOXED: " + why
    print(f"sandbox server on http://{host}:{server.server_address[1]}/run_code ({mode}; {max_workers} programs at a "
          "time)", file=sys.stderr, flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
