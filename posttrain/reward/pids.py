"""A per-run process-count limit: a cgroup `pids` controller where this machine lets us create one.

`RLIMIT_NPROC` does not stop root, so a fork bomb run by a root trainer needs the kernel's pids controller: a child
cgroup (v2 with `pids` delegated, or the v1 `pids` hierarchy) whose `pids.max` caps every process the program starts.
Where none can be created, the sandbox falls back to watching the process tree (`descendants`) and killing the run
when it grows past the limit.
"""

from __future__ import annotations

import itertools
import os
import signal
import subprocess
import time
from pathlib import Path

_PREFIX = "posttrain-sandbox-"
_counter = itertools.count()
_base: "Path | None | bool" = False  # False: not probed yet; None: no usable pids cgroup


def _candidates() -> list[Path]:
    """Cgroup folders this process lives in that could hold a child with a pids controller."""
    out = []
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return out
    root = Path("/sys/fs/cgroup")
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        rel = path.lstrip("/")
        if controllers == "":  # cgroup v2: mounted at /sys/fs/cgroup, or at /sys/fs/cgroup/unified in hybrid mode
            out += [root / rel, root / "unified" / rel]
        elif "pids" in controllers.split(","):
            out.append(root / "pids" / rel)
    return out


def _probe() -> Path | None:
    for parent in _candidates():
        if not (parent / "cgroup.procs").is_file():
            continue
        _sweep(parent)
        trial = parent / f"{_PREFIX}probe-{os.getpid()}"
        try:
            trial.mkdir(exist_ok=True)
        except OSError:
            continue
        usable = (trial / "pids.max").is_file() and _can_join(trial)
        for _ in range(100):  # the trial process may take a moment to leave
            try:
                trial.rmdir()
                break
            except FileNotFoundError:
                break
            except OSError:
                time.sleep(0.01)
        if usable:
            return parent
    return None


def _can_join(cgroup: Path) -> bool:
    """Whether a process can move itself into the cgroup (cgroup v2 refuses it in some layouts)."""
    try:
        done = subprocess.run(["/bin/sh", "-c", 'echo $$ > "$0"', str(cgroup / "cgroup.procs")], capture_output=True,
                              timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0


def _sweep(parent: Path) -> None:
    """Remove empty run cgroups left by scorer processes that were killed before they could clean up."""
    for stale in parent.glob(f"{_PREFIX}*"):
        try:
            owner = int(stale.name[len(_PREFIX):].split("-")[0])
        except ValueError:
            continue
        if owner != os.getpid() and not Path(f"/proc/{owner}").exists():
            try:
                stale.rmdir()
            except OSError:
                pass


def cgroup_base() -> Path | None:
    """The cgroup under which run cgroups are made, or None where no pids controller can be used (cached)."""
    global _base
    if _base is False:
        _base = _probe()
    return _base


class PidsCgroup:
    """One run's cgroup: `procs` is the file the launcher writes its own pid into before it execs the sandbox."""

    def __init__(self, base: Path, max_pids: int):
        self.path = base / f"{_PREFIX}{os.getpid()}-{next(_counter)}"
        self.path.mkdir()
        (self.path / "pids.max").write_text(str(max_pids))
        self.procs = self.path / "cgroup.procs"

    def hit_limit(self) -> bool:
        """Whether a fork was refused because of pids.max."""
        for name in ("pids.events", "pids.events.local"):
            try:
                text = (self.path / name).read_text()
            except OSError:
                continue
            for line in text.splitlines():
                key, _, value = line.partition(" ")
                if key == "max" and value.strip() not in ("", "0"):
                    return True
        return False

    def kill_all_and_remove(self, wait_s: float = 2.0) -> None:
        """SIGKILL every process still in the cgroup, then remove it."""
        deadline = time.monotonic() + wait_s
        while True:
            try:
                pids = [int(p) for p in self.procs.read_text().split()]
            except OSError:
                pids = []
            if not pids:
                break
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            if time.monotonic() > deadline:
                break
            time.sleep(0.01)
        for _ in range(50):
            try:
                self.path.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError:
                time.sleep(0.01)


def descendants(root_pid: int) -> list[int]:
    """Pids of every live descendant of `root_pid` (a sandbox's pid-namespace init adopts orphans, so this is every
    process the program started)."""
    children: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        ppid = int(stat[stat.rindex(b")") + 2:].split()[1])
        children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [root_pid]
    while todo:
        for child in children.get(todo.pop(), ()):
            out.append(child)
            todo.append(child)
    return out


def wait_gone(pid_list: list[int], timeout_s: float = 5.0) -> None:
    """Wait until none of these processes is alive (zombies waiting for their reaper count as gone)."""
    deadline = time.monotonic() + timeout_s
    pending = list(pid_list)
    while pending and time.monotonic() < deadline:
        still = []
        for pid in pending:
            try:
                with open(f"/proc/{pid}/stat", "rb") as f:
                    stat = f.read()
                if stat[stat.rindex(b")") + 2:][:1] not in (b"Z", b"X"):
                    still.append(pid)
            except OSError:
                pass
        pending = still
        if pending:
            time.sleep(0.01)
