"""Hostile programs scored as code rewards: each is contained and scored 0, nothing outside the sandbox changes and
no process it started survives. (The refusal where no sandbox can start: test_code_reward.py.)"""

import os
import shutil
import socket
import sys
import tempfile
import uuid
from pathlib import Path

import pytest

from posttrain.reward import pids, sandbox
from posttrain.reward.code import CodeSettings, compute_score
from posttrain.reward.sandbox import Limits, run_program

pytestmark = pytest.mark.skipif(not sandbox.sandbox_status()[0], reason="no bubblewrap sandbox on this machine")

SETTINGS = CodeSettings(run_timeout=2.0, memory_limit_mb=256)
ADD_TESTS = '{"fn_name": "add", "inputs": [[1, 2]], "outputs": [3]}'


def alive_with(marker: str) -> list[int]:
    """Pids of live processes whose command line mentions `marker`."""
    out = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                if marker.encode() in Path(f"/proc/{entry.name}/cmdline").read_bytes():
                    out.append(int(entry.name))
            except OSError:
                pass
    return out


def leftover_cgroups() -> list[Path]:
    base = pids.cgroup_base()
    return list(base.glob(f"posttrain-sandbox-{os.getpid()}-*")) if base else []


def score(program: str, ground_truth: str = ADD_TESTS, settings: CodeSettings = SETTINGS) -> dict:
    return compute_score(f"```python\n{program}\n```", ground_truth, {"language": "python"}, settings)


@pytest.fixture
def run_dir(tmp_path, monkeypatch):
    """A run folder as the current directory, a home folder, and a secret in both and in the environment."""
    run, home = tmp_path / "run", tmp_path / "home"
    for d in (run, home):
        d.mkdir()
        (d / "secret.txt").write_text("s3cret-run-value")
    monkeypatch.chdir(run)
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("POSTTRAIN_TEST_SECRET", "s3cret-run-value")
    return run, home


def snapshot(*dirs: Path) -> dict:
    return {p: p.read_bytes() for d in dirs for p in sorted(d.rglob("*")) if p.is_file()}


def test_the_reference_solution_scores_one():
    assert score("def add(a, b):\n    return a + b") == {"score": 1.0, "acc": 1.0, "pass_rate": 1.0}


@pytest.mark.parametrize("with_cgroup", [True, False], ids=["pids-cgroup", "process-watch"])
def test_fork_bomb_is_contained(with_cgroup, monkeypatch):
    if with_cgroup and pids.cgroup_base() is None:
        pytest.skip("no pids cgroup can be created here")
    if not with_cgroup:
        monkeypatch.setattr(pids, "cgroup_base", lambda: None)
    marker = uuid.uuid4().hex
    bomb = f"import os\n# {marker}\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass"
    result = run_program(bomb, limits=Limits(wall_s=2.0, memory_mb=256))
    assert not result.ok and result.execution_time < 10
    assert "process limit" in result.reason
    assert score(bomb)["score"] == 0.0
    assert not alive_with("/tmp/.posttrain/main.py") and not leftover_cgroups()


def test_memory_hog_is_stopped():
    hog = "chunks = []\nwhile True:\n    chunks.append(bytearray(50 * 1024 * 1024))"
    result = run_program(hog, limits=Limits(wall_s=5.0, memory_mb=256))
    assert result.status == "Finished" and result.return_code != 0 and "MemoryError" in result.stderr
    assert score(hog)["score"] == 0.0


@pytest.mark.parametrize("program", ["while True:\n    pass", "import time\ntime.sleep(60)"], ids=["loop", "sleep"])
def test_programs_past_the_time_limit_are_killed(program):
    result = run_program(program, limits=Limits(wall_s=1.0))
    assert result.status == "TimeLimitExceeded" and 1.0 <= result.execution_time < 3.0
    assert score(program)["score"] == 0.0
    assert not alive_with("/tmp/.posttrain/main.py")


def test_no_network():
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    listener.settimeout(0.2)
    port = listener.getsockname()[1]
    program = (f"import socket\nfor host in ('127.0.0.1', '1.1.1.1', 'example.com'):\n    try:\n"
               f"        socket.create_connection((host, {port}), timeout=1).sendall(b'x')\n        print('REACHED')\n"
               f"    except OSError as e:\n        print('BLOCKED', e)\ndef add(a, b):\n    return 0")
    result = run_program(program, limits=Limits(wall_s=5.0))
    assert "REACHED" not in result.stdout and result.stdout.count("BLOCKED") == 3
    assert score(program)["score"] == 0.0
    with pytest.raises(socket.timeout):
        listener.accept()  # nothing reached the host
    listener.close()


def test_writes_outside_tmp_change_nothing(run_dir, tmp_path):
    run, home = run_dir
    before = snapshot(run, home)
    targets = [run / "pwned", home / "pwned", tmp_path / "pwned", Path("/etc/posttrain-pwned"),
               Path(sys.prefix) / "posttrain-pwned", Path("/var/tmp/posttrain-pwned")]
    program = ("import os\nfor t in %r:\n    try:\n        os.makedirs(os.path.dirname(t), exist_ok=True)\n"
               "        open(t, 'w').write('x')\n    except OSError as e:\n        print(e)\n"
               "open('/tmp/inside', 'w').write('a private /tmp is writable')\n"
               "def add(a, b):\n    return 0") % [str(t) for t in targets]
    result = run_program(program)
    assert result.ok  # it ran, its writes went nowhere the host can see
    assert score(program)["score"] == 0.0
    assert not any(t.exists() for t in targets)
    assert snapshot(run, home) == before


def test_user_files_and_environment_are_unreadable(run_dir):
    run, home = run_dir
    program = (f"import os\nfound = [v for v in os.environ.values() if 's3cret' in v]\n"
               f"for p in {[str(run / 'secret.txt'), str(home / 'secret.txt'), os.path.expanduser('~root')]!r}:\n"
               "    try:\n        found.append(open(p).read())\n    except OSError:\n        pass\n"
               "print(found[0] if found else 'nothing')")
    gt = '{"inputs": [""], "outputs": ["s3cret-run-value"]}'  # reading the secret would earn the reward
    assert run_program(program).stdout.strip() == "nothing"
    # daemons' unix sockets under /run are out of reach too (a network namespace does not cover them)
    assert run_program("import os\nprint(os.listdir('/run'), os.listdir('/var/run'))").stdout == "[] []\n"
    assert score(program, gt)["score"] == 0.0


@pytest.mark.skipif(not os.path.isdir("/var/tmp"), reason="no /var/tmp")
def test_a_named_run_folder_is_hidden_wherever_it_lies():
    folder = Path(tempfile.mkdtemp(dir="/var/tmp", prefix="posttrain-run-folder-"))
    try:
        (folder / "secret.txt").write_text("s3cret")
        program = f"import os\nprint(os.listdir({str(folder)!r}))"
        assert run_program(program).stdout == "['secret.txt']\n"  # elsewhere the file system is readable
        assert run_program(program, hide=(str(folder),)).stdout == "[]\n"
        settings = CodeSettings(run_timeout=2.0, hide=(str(folder),))
        gt = '{"inputs": [""], "outputs": ["s3cret"]}'
        assert score(f"print(open({str(folder / 'secret.txt')!r}).read())", gt, settings)["score"] == 0.0
        assert score("print('s3cret')", gt, settings)["score"] == 1.0
    finally:
        shutil.rmtree(folder)


def test_giant_output_is_cut():
    program = "while True:\n    print('x' * 100000)"
    result = run_program(program, limits=Limits(wall_s=5.0, max_output_bytes=1 << 20))
    assert result.status == "Error" and result.reason == "output limit" and len(result.stdout) <= 1 << 20
    assert score(program)["score"] == 0.0


def test_signals_to_its_parent_reach_nothing_outside():
    program = (f"import os, signal\nfor pid in (os.getppid(), 1, {os.getpid()}, {os.getppid()}):\n    try:\n"
               "        os.kill(pid, signal.SIGKILL)\n    except OSError as e:\n        print(e)\n"
               "os.kill(-1, signal.SIGKILL)")
    run_program(program)
    assert score(program)["score"] == 0.0  # and this process is still here to check it


def test_background_processes_do_not_outlive_the_run():
    marker = uuid.uuid4().hex
    program = (f"import subprocess, sys, os\n"
               f"subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)', '{marker}'], "
               "start_new_session=True)\n"
               "if os.fork() == 0:\n    os.setsid()\n"
               f"    os.execv(sys.executable, [sys.executable, '-c', 'import time; time.sleep(300)', '{marker}'])\n"
               "def add(a, b):\n    return a + b")
    assert score(program)["score"] == 1.0  # a right answer still counts; what it left running does not survive
    assert not alive_with(marker) and not leftover_cgroups()
