"""Scorer worker processes: a per-task time limit, and a hung or crashed worker is replaced while the rest go on.

Why not `concurrent.futures.ProcessPoolExecutor`: it cannot stop one hung task (only the whole pool), and one worker
that dies breaks every task in flight. Here each worker takes one task at a time over its own pipe, so a timeout or a
crash costs that task and that worker only, and the counts are exact.

A worker is a fresh interpreter (`python -m posttrain.reward.pool FD`), not a fork of the training process (which has
torch threads and maybe CUDA) and not a multiprocessing spawn/forkserver child: those re-run the user's main script in
every worker, which breaks any script without an `if __name__ == "__main__":` guard. So the scorer must be importable
by reference (a module-level function; `custom_reward_function.path` files are loaded by path), and the worker gets the
parent's `sys.path`. Workers start at the first call and are kept across calls. Each leads its own process group, so a
scorer may start processes of its own (a code sandbox does), a timeout kills those too, and Ctrl-C in a terminal
reaches only the trainer. A launcher stops a rank of a multi-process job by signalling the rank's process group, so a
worker must never die of a signal sent to the trainer's group (it did while starting up, and the rank then failed
sending it the scorer): the session is made before the interpreter starts, not by the worker once running, and the
worker is started with SIGTERM and SIGINT blocked, dropping one that reached it before it left the group (see
`_spawn`). On Linux a worker also dies with its parent. This module imports only the standard library.
"""

from __future__ import annotations

import atexit
import os
import pickle
import signal
import socket
import subprocess
import sys
import time
import traceback
import weakref
from collections import deque
from multiprocessing.connection import Connection, wait

OK, ERROR, TIMEOUT, CRASH = "ok", "error", "timeout", "crash"
READY = "ready"  # a worker's first message: the scorer is imported, time limits start now
START_LIMIT_S = 120.0  # how long a worker may take to import the scorer before its job fails
_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # holds this posttrain
_LIVE: "weakref.WeakSet[ScorerPool]" = weakref.WeakSet()


def _die_with_parent() -> None:
    if sys.platform.startswith("linux"):
        try:
            import ctypes

            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass


def _serve(conn: Connection) -> None:
    """Worker loop: (sys.path, pickled scorer) first, READY once it is loaded, then args -> (status, value) until the
    parent closes the pipe."""
    path, payload = conn.recv()
    sys.path[:] = path
    try:
        fn, load_error = pickle.loads(payload), None
    except BaseException:  # e.g. the scorer's module does not import here: every task reports why
        fn, load_error = None, "the scorer could not be loaded in a worker process:\n" + traceback.format_exc(limit=4)
    conn.send(READY)
    while True:
        try:
            args = conn.recv()
        except (EOFError, OSError):
            return
        if load_error is not None:
            result = (ERROR, load_error)
        else:
            try:
                result = (OK, fn(*args))
            except BaseException:  # the scorer is user code: anything it raises (SystemExit too) is contained
                result = (ERROR, traceback.format_exc(limit=4))
        try:
            conn.send(result)
        except Exception as e:  # pickling failed before anything was written
            conn.send((ERROR, f"the scorer returned a value that cannot be sent back ({type(result[1]).__name__}): {e}"))


_HELD = {signal.SIGTERM, signal.SIGINT}  # what a launcher or a terminal sends the trainer's process group


def _spawn(argv: list[str], **kwargs) -> subprocess.Popen:
    """Start a worker in a session of its own, with SIGTERM and SIGINT blocked. The child is made in the caller's
    process group and only then leaves it (setsid): a signal sent to that group in between would reach the child with
    the default action already restored, and kill it (measured: a group signalled every 0.5 ms killed 93 of 200 such
    children; none with the signals blocked). Blocked, it stays pending until the worker drops it (`_drop_held`)."""
    held = signal.pthread_sigmask(signal.SIG_BLOCK, _HELD)  # this thread only; the child inherits it through exec
    try:
        return subprocess.Popen(argv, start_new_session=True, **kwargs)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, held)


def _drop_held() -> None:
    """In the worker: discard a SIGTERM/SIGINT meant for the trainer's group that arrived while this process was
    still in it (setting a pending signal to ignored discards it), then take signals as usual."""
    for s in _HELD:
        signal.signal(s, signal.signal(s, signal.SIG_IGN))
    signal.pthread_sigmask(signal.SIG_UNBLOCK, _HELD)


class _Worker:
    def __init__(self, path: list[str], payload: bytes):
        ours, theirs = socket.socketpair()
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([_ROOT, os.environ.get("PYTHONPATH", "")]))
        self.proc = _spawn([sys.executable, "-m", "posttrain.reward.pool", str(theirs.fileno())],
                           pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL, env=env)
        theirs.close()
        self.conn = Connection(ours.detach())
        self.conn.send((path, payload))  # buffered by the socket; the worker reads it once it has started
        self.ready = False  # until its READY message is read

    def kill(self) -> None:
        """SIGKILL the worker's whole process group (the processes its scorer started too), then reap it."""
        for kill in (lambda: os.killpg(self.proc.pid, signal.SIGKILL), self.proc.kill):
            try:
                kill()
                break
            except OSError:  # already gone
                continue
        self.proc.wait()
        self.conn.close()


def _close_all() -> None:
    for pool in list(_LIVE):
        pool.close()


atexit.register(_close_all)


class ScorerPool:
    """`map(jobs, timeout_s)` calls `fn(*job)` for each job in worker processes; results keep the jobs' order.

    Each result is (OK, value), (ERROR, traceback text), (TIMEOUT, None) or (CRASH, how the worker ended).
    A job's `timeout_s` counts from when its worker is ready (has imported the scorer), so a replacement worker's
    start-up never counts against the job it takes over; start-up itself may take up to START_LIMIT_S.
    """

    def __init__(self, fn, num_workers: int):
        if num_workers < 1:
            raise ValueError(f"a scorer pool needs at least one worker, got {num_workers}")
        if getattr(fn, "__module__", None) == "__main__":
            raise TypeError(f"the reward function {fn!r} is defined in the main script, which scorer worker "
                            "processes do not import; move it to a module (or a custom_reward_function.path file), or "
                            "set reward_model.num_workers=0 to score in the training process")
        try:
            self._payload = pickle.dumps(fn)
        except Exception as e:
            raise TypeError(f"the reward function {fn!r} cannot be sent to scorer worker processes ({e}); define it "
                            "at module level in an importable file, or set reward_model.num_workers=0 to score in "
                            "the training process") from None
        self.num_workers = num_workers
        self._workers: list[_Worker] = []
        self.replaced = 0  # workers killed (timeout) or lost (crash) and started anew

    def start(self) -> None:
        """Start any missing workers now (they import in the background while the caller goes on)."""
        _LIVE.add(self)
        while len(self._workers) < self.num_workers:
            self._workers.append(_Worker(list(sys.path), self._payload))

    def map(self, jobs: list[tuple], timeout_s: float) -> list[tuple[str, object]]:
        self.start()
        results: list = [None] * len(jobs)
        todo = deque(range(len(jobs)))
        idle = list(self._workers)
        busy: dict = {}  # conn -> (worker, job index, deadline)
        while todo or busy:
            while todo and idle:
                worker, i = idle.pop(), todo.popleft()
                try:
                    worker.conn.send(jobs[i])
                except OSError:  # the worker died while idle: replace it and give the job to another
                    todo.appendleft(i)
                    idle.append(self._replace(worker))
                    continue
                except Exception as e:  # the sample does not pickle
                    results[i] = (ERROR, f"the sample cannot be sent to a scorer worker: {e}")
                    idle.append(worker)
                    continue
                # a worker not known to be ready gets START_LIMIT_S to import the scorer; its READY restarts the clock
                busy[worker.conn] = (worker, i, time.monotonic() + (timeout_s if worker.ready else START_LIMIT_S))
            if not busy:
                continue
            next_deadline = min(d for _, _, d in busy.values())
            for conn in wait(list(busy), timeout=max(0.0, next_deadline - time.monotonic())):
                worker, i, _ = busy.pop(conn)
                try:
                    message = conn.recv()
                    if message == READY:  # a fresh worker has imported the scorer: its job's time starts now
                        worker.ready = True
                        busy[conn] = (worker, i, time.monotonic() + timeout_s)
                        continue
                    results[i] = message
                    idle.append(worker)
                except (EOFError, OSError):
                    code = worker.proc.wait()
                    how = f"killed by signal {-code}" if code < 0 else f"exit code {code}"
                    results[i] = (CRASH, f"the scorer's worker process died ({how})")
                    idle.append(self._replace(worker))
            now = time.monotonic()
            for conn, (worker, i, deadline) in list(busy.items()):
                if deadline <= now:
                    del busy[conn]
                    results[i] = ((TIMEOUT, None) if worker.ready else
                                  (ERROR, f"the scorer's worker process did not start within {START_LIMIT_S:g} s "
                                          "(importing the scorer's module)"))
                    idle.append(self._replace(worker))
        return results

    def _replace(self, worker: _Worker) -> _Worker:
        worker.kill()
        fresh = _Worker(list(sys.path), self._payload)
        self._workers[self._workers.index(worker)] = fresh
        self.replaced += 1
        return fresh

    def close(self) -> None:
        for worker in self._workers:
            worker.kill()
        self._workers = []
        _LIVE.discard(self)


if __name__ == "__main__":
    _drop_held()
    _die_with_parent()
    _serve(Connection(int(sys.argv[1])))
