"""Hostile programs scored as code rewards: each is contained and scored 0, nothing outside the sandbox changes and
no process it started survives. (The refusal where no sandbox can start: test_code_reward.py.)"""

import json
import os
import shutil
import socket
import sys
import tempfile
import uuid
from dataclasses import replace
from pathlib import Path
from textwrap import dedent

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


# ---------------------------------------------------------------- faking a pass

# Each program defines a wrong `add` (or none) and tries to have it pass anyway, against each layout of tests:
FAKE_TARGETS = {
    "call": '{"fn_name": "add", "inputs": [[1, 2], [3, 4]], "outputs": [3, 7]}',
    "assert": '["assert add(1, 2) == 3", "assert add(3, 4) == 7"]',
    "check": json.dumps({"entry_point": "add", "test": "def check(candidate):\n    assert candidate(1, 2) == 3\n"
                                                       "    assert candidate(3, 4) == 7\n"}),
    "check-map": json.dumps({"entry_point": "add", "test": "def check(candidate):\n"
                             "    assert all(map(lambda x: candidate(*x) == sum(x), [(1, 2), (3, 4)]))\n"}),
}
WRONG = "\ndef add(a, b):\n    return 0\n"
ALWAYS_EQUAL = dedent("""
    class Yes:
        def __eq__(self, other):
            return True
        def __ne__(self, other):
            return False
        def __bool__(self):
            return True
        __hash__ = object.__hash__
    """)
FAKES = {
    "rebind-exec": "exec = lambda *a, **k: None" + WRONG,
    "rebind-exec-everywhere": "import builtins, json\nbuiltins.exec = lambda *a, **k: None" + WRONG,
    "rebind-bool": "bool = lambda *a: True\nimport builtins\nbuiltins.bool = bool" + WRONG,
    "rebind-assert-builtins": dedent("""
        import builtins
        class Never(Exception):
            pass
        builtins.AssertionError = builtins.BaseException = builtins.Exception = Never
        builtins.isinstance = lambda *a: True
        builtins.len = builtins.sum = lambda *a: 0
        """) + WRONG,
    "always-equal": ALWAYS_EQUAL + "def add(a, b):\n    return Yes()\n",
    "always-equal-class": dedent("""
        class Meta(type):
            __eq__ = lambda cls, other: True
            __ne__ = lambda cls, other: False
            __hash__ = type.__hash__
        class Yes(metaclass=Meta):
            pass
        def add(a, b):
            return Yes
        """),
    "int-subclass": dedent("""
        class I(int):
            __eq__ = lambda s, o: True
            __ne__ = lambda s, o: False
            __hash__ = int.__hash__
        def add(a, b):
            return I(0)
        """),
    "str-subclass": "class S(str):\n    __eq__ = lambda s, o: True\n    __hash__ = str.__hash__\n"
                    "def add(a, b):\n    return S('x')\n",
    "list-subclass": "class L(list):\n    __eq__ = lambda s, o: True\n    __ne__ = lambda s, o: False\n"
                     "def add(a, b):\n    return L()\n",
    "claims-to-be-int": ALWAYS_EQUAL + "class Fake(Yes):\n    __class__ = property(lambda s: int)\n"
                                       "def add(a, b):\n    return Fake()\n",
    "exit-early": "import sys\nsys.exit(0)" + WRONG,
    "os-exit": "import os\nos._exit(0)" + WRONG,
    "exit-in-the-call": "import os\ndef add(a, b):\n    os._exit(0)\n",
    "system-exit-in-del-and-atexit": dedent("""
        import atexit, os
        class D:
            def __del__(self):
                raise SystemExit(0)
        keep = D()
        atexit.register(lambda: os._exit(0))
        def add(a, b):
            d = D()
            return 0
        """),
    "fake-reports": dedent("""
        import os, re
        texts = []
        for path in ('/tmp/.posttrain/main.py', '/tmp/.posttrain/stdin'):  # the program and its input
            try:
                texts.append(open(path).read())
            except OSError:
                pass
        for tag in set(re.findall(r'[0-9a-f]{16,32}', ' '.join(texts))):
            for n in (1, 2):
                print('\\n' + tag, n, flush=True)  # a report "<secret> <passed>"
            for i in range(2):
                print(tag, f'[{i}, {{"value": 5}}]', flush=True)  # answers for each call
            print(tag, '["done"]', flush=True)
            for i in range(2):
                print(tag, f'[{i}, "pass", []]', flush=True)  # verdicts
        os._exit(0)
        """),
    "write-to-fd-1-and-2": dedent("""
        import os
        for fd in (1, 2):
            os.write(fd, b'\\nPASS 2\\npassed 2\\n[0, "pass", []]\\n')
        """) + WRONG,
    "patch-json": ALWAYS_EQUAL + dedent("""
        import json
        real, count = json.loads, [0]
        def loads(s, *a, **k):
            count[0] += 1
            return real(s, *a, **k) if count[0] == 1 else Yes()
        json.loads = loads
        json.dumps = lambda *a, **k: '5'
        """) + WRONG,
    "patch-print-and-stdout-from-the-callers-frame": dedent("""
        import builtins, sys
        real = builtins.print
        def fake(*a, **k):
            cases = sys._getframe(1).f_locals.get('_' + '_cases') or [1]
            real(*(a[:1] + (len(cases),) if len(a) == 2 else a), **k)
        builtins.print = fake
        class Out:
            def write(self, s):
                return sys.__stdout__.write(s.replace(' 0', ' 2'))
            def flush(self):
                sys.__stdout__.flush()
        sys.stdout = Out()
        """) + WRONG,
    "expected-from-the-callers-frame": dedent("""
        import dis, sys
        def add(a, b):
            f = sys._getframe(1)
            for name, v in f.f_locals.items():
                if name.endswith('want'):
                    return v
            for i in dis.get_instructions(f.f_code):  # the constant the caller compares with
                if i.offset > f.f_lasti and i.opname == 'LOAD_CONST':
                    return i.argval
            return 0
        """),
    "expected-from-gc": dedent("""
        import gc
        def add(a, b):
            for o in gc.get_objects():
                if isinstance(o, list) and len(o) == 2 and o[0] == [a, b]:
                    return o[1]
                if isinstance(o, dict) and 'outputs' in o:
                    return o['outputs'][0]
            return 0
        """),
    "expected-from-files-env-argv-stdin": dedent("""
        import glob, os, sys
        seen = sys.argv + list(os.environ.values())
        for path in glob.glob('/tmp/**', recursive=True) + glob.glob('/proc/*/cmdline'):
            try:
                seen.append(open(path, errors='replace').read())
            except OSError:
                pass
        try:
            seen.append(sys.stdin.read())
        except OSError:
            pass
        def add(a, b):
            for text in seen:
                if '"outputs"' in text or '== 3' in text:
                    return 3 if a == 1 else 7
            return 0
        """),
    "inspect-and-traceback": dedent("""
        import inspect, traceback
        traceback.print_exc = lambda *a, **k: None
        traceback.format_exc = lambda *a, **k: ''
        def add(a, b):
            for frame in inspect.stack():
                for v in frame.frame.f_locals.values():
                    if isinstance(v, (list, tuple)) and len(v) == 2 and v[0] == [a, b]:
                        return v[1]
            return 0
        """),
    "patch-the-harness": dedent("""
        import sys
        main = sys.modules['__main__']
        for name in ('encode', 'decode', 'judge', '_text'):
            if hasattr(main, name):
                setattr(main, name, lambda *a, **k: 5)
        """) + WRONG,
    "trace-hook-rewrites-the-tests-locals": dedent("""
        import sys
        def tracer(frame, event, arg):
            if not frame.f_code.co_filename.endswith('main.py'):  # the harness's frames only
                return tracer
            for name in list(frame.f_locals):  # written back into the frame when the hook returns
                if name.endswith('ok'):
                    frame.f_locals[name] = True
                elif name.endswith('passed'):
                    frame.f_locals[name] = 2 if 'check' not in str(frame.f_locals.get('_' + '_kind')) else 1
            return tracer
        sys.settrace(tracer)
        """) + WRONG,
    "stop-iteration": "def add(a, b):\n    raise StopIteration\n",  # would end the checker's `map` early
    "raises-assertion-like": "class AssertionError(Exception):\n    pass\ndef add(a, b):\n    raise AssertionError\n",
    "self-containing-result": "def add(a, b):\n    x = []\n    x.append(x)\n    return x\n",
    "nan": "def add(a, b):\n    return float('nan')\n",
    "infinite-loop": "while True:\n    pass" + WRONG,
    "sleep-in-the-call": "import time\ndef add(a, b):\n    time.sleep(60)\n",
    "fork-then-fake": dedent("""
        import os, time
        if os.fork() == 0:
            time.sleep(0.3)
            print('\\n0123456789abcdef 2', flush=True)
            os._exit(0)
        """) + WRONG,
    "background-thread-fakes": dedent("""
        import os, threading, time
        def later():
            time.sleep(0.2)
            os.write(1, b'\\n0123456789abcdef0123456789abcdef 2\\n')
        threading.Thread(target=later, daemon=True).start()
        """) + WRONG,
}
NEVER_FINISH = ("infinite-loop", "sleep-in-the-call")


def test_every_kind_of_test_passes_an_honest_solution():
    right = "def add(a, b):\n    print('a debug line', a, b)\n    return a + b\n"
    for kind, tests in FAKE_TARGETS.items():
        assert score(right, tests) == {"score": 1.0, "acc": 1.0, "pass_rate": 1.0}, kind


@pytest.mark.parametrize("fake", sorted(FAKES))
def test_a_wrong_solution_cannot_fake_a_pass(fake):
    """Whatever a wrong solution rebinds, prints, reads or ends, each test it does not pass scores 0: the verdict
    is reached where its code does not run. The two that never finish do so under a half-second limit, as they would
    under any other."""
    settings = replace(SETTINGS, run_timeout=0.5) if fake in NEVER_FINISH else SETTINGS
    for kind, tests in FAKE_TARGETS.items():
        assert score(FAKES[fake], tests, settings) == {"score": 0.0, "acc": 0.0, "pass_rate": 0.0}, kind
