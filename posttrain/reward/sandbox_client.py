"""Client for a SandboxFusion-compatible code runner (`reward_model.sandbox_fusion.url`): SandboxFusion itself, or
`posttrain sandbox-server` on another machine.

POST {url}/run_code with {"code", "language", "run_timeout", "memory_limit_MB", "stdin"}; the answer's `run_result`
({"status", "stdout", "stderr", "return_code", "execution_time"}) becomes a RunResult. `url` may name the endpoint
itself (ending in /run_code) or the server's root.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request

from .sandbox import ERROR, FINISHED, TIME_LIMIT, RunResult

_RETRIES = 3
_gates: dict[tuple[str, int], threading.BoundedSemaphore] = {}
_gates_lock = threading.Lock()


class SandboxServerError(RuntimeError):
    """The server could not run the program (unreachable, a sandbox error, or a malformed answer)."""


def endpoint(url: str) -> str:
    url = url.rstrip("/")
    return url if url.endswith("/run_code") else url + "/run_code"


def _gate(url: str, max_concurrent: int) -> threading.BoundedSemaphore:
    """At most `max_concurrent` requests in flight to one server from this process."""
    with _gates_lock:
        return _gates.setdefault((url, max_concurrent), threading.BoundedSemaphore(max_concurrent))


def run_remote(url: str, code: str, language: str = "python", stdin: str = "", *, run_timeout: float = 5.0,
               memory_limit_mb: int = 1024, max_concurrent: int = 64) -> RunResult:
    """Run one program on the server; connection failures are retried a few times, then raised."""
    body = json.dumps({"code": code, "language": language, "run_timeout": run_timeout,
                       "memory_limit_MB": memory_limit_mb, "stdin": stdin}).encode()
    target = endpoint(url)
    last: Exception | None = None
    with _gate(target, max_concurrent):
        for attempt in range(_RETRIES):
            request = urllib.request.Request(target, data=body, headers={"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(request, timeout=run_timeout + 30) as response:
                    answer = json.loads(response.read())
                break
            except urllib.error.HTTPError as e:  # the server answered: a refusal is not retried
                detail = e.read().decode(errors="replace")[:500]
                raise SandboxServerError(f"{target} answered HTTP {e.code}: {detail}") from None
            except (urllib.error.URLError, OSError, json.JSONDecodeError) as e:
                last = e
                time.sleep(0.2 * 2 ** attempt)
        else:
            raise SandboxServerError(f"{target} unreachable after {_RETRIES} tries: {last}")
    return parse_answer(answer, target)


def parse_answer(answer: dict, where: str = "sandbox server") -> RunResult:
    """A SandboxFusion /run_code answer as a RunResult; a SandboxError or a missing run_result raises."""
    if not isinstance(answer, dict):
        raise SandboxServerError(f"{where}: answer is not a JSON object: {str(answer)[:200]}")
    run = answer.get("run_result")
    if answer.get("status") == "SandboxError" or not isinstance(run, dict):
        raise SandboxServerError(f"{where}: {answer.get('status')}: {answer.get('message') or 'no run_result'}")
    status = run.get("status")
    if status not in (FINISHED, TIME_LIMIT, ERROR):
        raise SandboxServerError(f"{where}: unknown run status {status!r}")
    code = run.get("return_code")
    return RunResult(status, int(code) if code is not None and status == FINISHED else None, run.get("stdout") or "",
                     run.get("stderr") or "", float(run.get("execution_time") or 0.0), answer.get("message") or "")
