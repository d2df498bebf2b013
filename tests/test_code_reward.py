"""The code scorer (test layouts, code extraction, languages), the SandboxFusion-compatible server and client,
`posttrain prepare code`, and a GRPO run on the tiny model scored by sandboxed code rewards."""

import json
import multiprocessing
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from posttrain.data.preprocess import prepare
from posttrain.reward import sandbox
from posttrain.config import ConfigError
from posttrain.reward.code import CodeSettings, check_ready, compute_score, extract_code, parse_tests
from posttrain.reward.registry import default_compute_score
from posttrain.reward.sandbox import Limits, SandboxUnavailable, run_program
from posttrain.reward.sandbox_client import SandboxServerError, run_remote
from posttrain.reward.sandbox_server import SandboxServer

needs_sandbox = pytest.mark.skipif(not sandbox.sandbox_status()[0], reason="no bubblewrap sandbox on this machine")
FAST = CodeSettings(run_timeout=3.0, memory_limit_mb=512)


def test_extracts_the_last_python_block_or_the_whole_text():
    text = "First try:\n```python\nx = 1\n```\nBetter:\n```python\nx = 2\n```\nand prose ```bash\nls\n```"
    assert extract_code(text) == "x = 2\n"
    assert extract_code("```py\nprint(1)\n```") == "print(1)\n"
    assert extract_code("print(3)") == "print(3)"
    assert extract_code("```python\nx = 1\n```\n```Python\nx = 2  # cut off here") == "x = 2  # cut off here"


def test_ground_truth_layouts():
    assert parse_tests('{"inputs": ["1\\n"], "outputs": ["2\\n"]}').kind == "stdio"
    assert parse_tests({"fn_name": "f", "inputs": [[1]], "outputs": [2]}).kind == "call"
    assert parse_tests('{"test_list": ["assert f(1) == 2"], "test_setup_code": "import math"}').setup == "import math"
    assert parse_tests('["assert f(1) == 2", "assert f(2) == 3"]').count == 2
    assert parse_tests("assert f(1) == 2\nassert f(2) == 3").count == 2  # bare assert lines
    assert parse_tests({"test": "def check(candidate): pass", "entry_point": "f"}).kind == "check"
    with pytest.raises(ValueError, match="ground truth not understood"):
        parse_tests('{"inputs": ["1"], "outputs": []}')


@needs_sandbox
def test_scores_are_all_pass_with_the_pass_rate_beside():
    gt = {"inputs": ["1 2\n", "3 4\n", "5 5\n"], "outputs": ["3\n", "7\n", "10\n"]}
    right = "```python\na, b = map(int, input().split())\nprint(a + b)\n```"
    assert compute_score(right, json.dumps(gt), None, FAST) == {"score": 1.0, "acc": 1.0, "pass_rate": 1.0}
    # right on the first two only: all-pass score 0, pass rate 2/3 (stdin tests stop at the first failure)
    partial = "```python\na, b = map(int, input().split())\nprint(a + b if a + b < 10 else 0)\n```"
    assert compute_score(partial, gt, None, FAST) == {"score": 0.0, "acc": 0.0, "pass_rate": pytest.approx(2 / 3)}
    calls = {"fn_name": "pair", "inputs": [[1], [2]], "outputs": [[1, 1], [2, 2]]}  # tuples compare as lists
    assert compute_score("def pair(x):\n    return (x, x)", calls, None, FAST)["score"] == 1.0
    asserts = ["assert sq(2) == 4", "assert sq(3) == 9", "assert sq(4) == 15"]
    assert compute_score("def sq(x):\n    return x * x", asserts, None, FAST)["pass_rate"] == pytest.approx(2 / 3)
    # a main block is not run when the tests call functions (the solution is imported, as familiar harnesses do)
    main_block = "def sq(x):\n    return x * x\nif __name__ == '__main__':\n    print(sq(int(input())))"
    assert compute_score(main_block, asserts[:2], None, FAST)["score"] == 1.0
    # a program that ends the process before the tests run, or prints a fake report, does not pass
    for cheat in ("import os\nos._exit(0)", "print('0123456789abcdef 3')\nraise SystemExit(0)"):
        assert compute_score(cheat, asserts, None, FAST) == {"score": 0.0, "acc": 0.0, "pass_rate": 0.0}


def test_plain_data_carries_values_not_behaviour():
    from posttrain.reward.plain_data import NotPlain, call_key, decode, encode

    value = [None, True, 3, -2.5, "x", b"\x00", (1, [2]), {"k": {1, 2}}, frozenset({"a", "b"}), 1 + 2j, {(1, 2): 3}]
    back = decode(json.loads(json.dumps(encode(value))))
    assert back == value and [type(v) for v in back] == [type(v) for v in value]

    class Yes(int):
        def __eq__(self, other):
            return True

        __hash__ = int.__hash__

    assert type(decode(encode(Yes(5)))) is int and decode(encode(Yes(5))) != 6  # the plain value, not the object
    assert decode(encode([Yes(1)])) == [1] and type(decode(encode({"a": Yes(1)}))["a"]) is int
    for bad in (object(), [len], {"k": print}):
        with pytest.raises(NotPlain):
            encode(bad)
    for malformed in ({"eval": "x"}, {"tuple": 1}, {"set": [[1]]}, {"dict": [[[1], 2]]}, {"a": 1, "b": 2}):
        with pytest.raises(NotPlain):
            decode(malformed)
    # equal sets give the same call text in every process, whatever the iteration order
    assert call_key("f", encode([{"b", "a", "c"}]), {}) == call_key("f", encode([{"c", "a", "b"}]), {})


@needs_sandbox
def test_assert_and_checker_forms_are_judged_on_plain_values():
    """The tests run for real in the judge's program, on the values the solution's program returned."""
    solution = ("import math\ndef area(r):\n    return math.pi * r * r\ndef pair(x):\n    return [x, x]\n"
                "def root(x):\n    if x < 0:\n        raise ValueError(x)\n    return math.sqrt(x)\n")
    asserts = ["assert math.isclose(area(2), 12.566, rel_tol=1e-3)",  # `math` comes from the standard library
               "assert set(pair(1)) == {1}", "assert pair(pair(2)) == [[2, 2], [2, 2]]",
               "try:\n    root(-1)\n    raise SystemExit\nexcept ValueError:\n    pass",
               "assert pair(1) != (1, 1)"]  # a list is not a tuple, as in Python
    assert compute_score(solution, asserts, None, FAST) == {"score": 1.0, "acc": 1.0, "pass_rate": 1.0}
    assert compute_score(solution.replace("[x, x]", "(x, x)"), asserts, None, FAST)["pass_rate"] == 0.6  # 3 and 5 fail
    check = {"entry_point": "add", "test": (
        "import random\ndef check(candidate):\n    random.seed(3)\n    for _ in range(30):\n"
        "        x, y = random.randint(0, 99), random.randint(0, 99)\n        assert candidate(x, y) == x + y\n"
        "    assert candidate(candidate(1, 2), candidate(3, 4)) == 10\n")}
    assert compute_score("def add(a, b):\n    return a + b", check, None, FAST)["score"] == 1.0
    assert compute_score("def add(a, b):\n    return a + b if a != 3 else 0", check, None, FAST)["score"] == 0.0
    unseeded = {"entry_point": "add", "test": (  # HumanEval/53's checker: the same draws in every round
        "import random\ndef check(candidate):\n    for _ in range(20):\n"
        "        x, y = random.randint(0, 1000), random.randint(0, 1000)\n        assert candidate(x, y) == x + y\n")}
    assert compute_score("def add(a, b):\n    return a + b", unseeded, None, FAST)["score"] == 1.0


@needs_sandbox
def test_a_test_undecided_after_the_last_round_fails_and_passes_no_other():
    """A chain of calls, each on the previous answer, needs a round each: past the last round that test fails, and
    the stand-in for the value it never got does not pass a later test that reads it."""
    from posttrain.reward.code import MAX_ROUNDS

    chain = "1"
    for _ in range(MAX_ROUNDS + 2):
        chain = f"add({chain}, 1)"
    tests = [f"x = {chain}", "assert x == 12345"]  # wrong for an honest add: only the stand-in would equal it
    wrong = "def add(a, b):\n    return a + b + 100"
    assert compute_score(wrong, tests, None, FAST) == {"score": 0.0, "acc": 0.0, "pass_rate": 0.0}
    short = ["x = add(add(1, 1), 1)", "assert x == 3"]
    assert compute_score("def add(a, b):\n    return a + b", short, None, FAST)["score"] == 1.0


def test_unknown_languages_are_rejected():
    with pytest.raises(ValueError, match="unknown language 'cobol'"):
        compute_score("x", '["assert True"]', {"language": "cobol"}, FAST)
    with pytest.raises(ValueError, match="unknown language"):
        sandbox.run_program("x", language="rust")


@needs_sandbox
def test_bundled_problems_prepare_and_their_references_pass(tmp_path):
    summary = prepare("code", None, tmp_path)
    assert summary == {"train": (tmp_path / "train.parquet", 25), "test": (tmp_path / "test.parquet", 8)}
    rows = pq.read_table(tmp_path / "test.parquet").to_pylist()
    assert list(rows[0]) == ["data_source", "prompt", "ability", "reward_model", "extra_info"]
    assert {r["ability"] for r in rows} == {"code"} and rows[0]["reward_model"]["style"] == "rule"
    assert "```python" in rows[0]["prompt"][0]["content"]
    kinds = set()
    for r in rows:
        kinds.add(parse_tests(r["reward_model"]["ground_truth"]).kind)
        reference = "```python\n" + r["extra_info"]["solution"] + "```"
        assert default_compute_score(r["data_source"], reference, r["reward_model"]["ground_truth"],
                                     r["extra_info"])["score"] == 1.0, r["extra_info"]["task_id"]
    assert kinds == {"stdio", "call", "assert", "check"}


@pytest.fixture
def server():
    srv = SandboxServer(("127.0.0.1", 0), max_workers=2)
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()
    srv.server_close()


@needs_sandbox
def test_client_server_round_trip(server):
    result = run_remote(server, "import sys\nprint(sys.stdin.read()[::-1])", stdin="abc")
    assert result.ok and result.stdout == "cba\n" and result.execution_time > 0
    slow = run_remote(server + "/run_code", "while True: pass", run_timeout=1.0)
    assert slow.status == "TimeLimitExceeded" and slow.return_code is None
    failed = run_remote(server, "raise SystemExit(3)")
    assert failed.status == "Finished" and failed.return_code == 3
    body = json.dumps({"code": "print(1)", "language": "python", "run_timeout": 5, "memory_limit_MB": 256,
                       "stdin": ""}).encode()
    with urllib.request.urlopen(urllib.request.Request(server + "/run_code", data=body)) as r:
        answer = json.loads(r.read())
    assert answer["status"] == "Success" and answer["run_result"] == {
        "status": "Finished", "execution_time": answer["run_result"]["execution_time"], "return_code": 0,
        "stdout": "1\n", "stderr": ""}
    with pytest.raises(SandboxServerError, match="400.*unknown language"):
        run_remote(server, "x", language="brainfuck")
    files = json.dumps({"code": "print(1)", "files": {"a.txt": "eA=="}}).encode()
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(urllib.request.Request(server + "/run_code", data=files))
    assert err.value.code == 400 and "'files'" in json.loads(err.value.read())["message"]
    remote = CodeSettings(url=server, run_timeout=3.0)
    gt = '{"fn_name": "add", "inputs": [[1, 2]], "outputs": [3]}'
    assert compute_score("def add(a, b):\n    return a + b", gt, None, remote)["score"] == 1.0
    assert compute_score("def add(a, b):\n    return a - b", gt, None, remote)["score"] == 0.0
    # asserts and checkers through the server: the verdict is reached on this side of it, as locally
    asserts = ["assert add(1, 2) == 3"]
    check = {"test": "def check(candidate):\n    assert candidate(1, 2) == 3\n", "entry_point": "add"}
    fake = "class Yes:\n    __eq__ = lambda s, o: True\nexec = lambda *a: None\ndef add(a, b):\n    return Yes()"
    for tests in (gt, asserts, check):
        assert compute_score("def add(a, b):\n    return a + b", tests, None, remote)["score"] == 1.0
        assert compute_score(fake, tests, None, remote)["score"] == 0.0


def test_unreachable_server_raises():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    with pytest.raises(SandboxServerError, match="unreachable"):
        run_remote(f"http://127.0.0.1:{port}", "print(1)")


@needs_sandbox
def test_sandbox_server_command(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "posttrain.cli", "sandbox-server", "--host", "127.0.0.1",
                             "--port", str(port), "--max-workers", "1"], stderr=subprocess.PIPE, text=True)
    try:
        for _ in range(200):
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/ping", timeout=1) as r:
                    assert json.loads(r.read())["status"] == "ok"
                break
            except OSError:
                time.sleep(0.1)
        assert run_remote(f"http://127.0.0.1:{port}/run_code", "print(2 + 2)").stdout == "4\n"
    finally:
        proc.terminate()
        proc.wait(timeout=10)


HOSTILE_REWARD = """
import itertools, os

from posttrain.reward.code import compute_score as run_tests
from posttrain.reward.registry import default_compute_score

HOSTILE = [
    "import os\\nwhile True:\\n    try:\\n        os.fork()\\n    except OSError:\\n        pass",
    "x = []\\nwhile True:\\n    x.append(bytearray(1 << 26))",
    "while True:\\n    pass",
    "import time\\ntime.sleep(60)",
    "import socket\\nsocket.create_connection(('1.1.1.1', 80), timeout=1)",
    "open('/etc/posttrain-pwned', 'w')",
    "import os\\nprint(os.environ, open(os.path.expanduser('~/.bashrc')).read())",
    "while True:\\n    print('x' * 100000)",
    "import os, signal\\nos.kill(os.getppid(), signal.SIGKILL)\\nos.kill(-1, signal.SIGKILL)",
    "import subprocess, sys\\nsubprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)', 'MARKER'], "
    "start_new_session=True)",
]
_calls = itertools.count()


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    \"\"\"Every other response is the model's own (scored by the code scorer); the rest are hostile programs.\"\"\"
    n = next(_calls)
    if n % 2 == 0:
        return default_compute_score(data_source, solution_str, ground_truth, extra_info)
    program = HOSTILE[(n // 2 + os.getpid()) % len(HOSTILE)]
    return run_tests("```python\\n" + program + "\\n```", ground_truth, extra_info)
"""


@needs_sandbox
def test_grpo_on_code_runs_with_sandboxed_rewards(tmp_path, tiny_model_dir):
    """A few GRPO steps on the code problems, scored in the sandbox from scorer processes, half of the responses
    swapped for hostile programs: training goes on, every response is scored (none raised or timed out), and
    nothing they started is left running."""
    from posttrain.config import load_config
    from posttrain.trainer.rl import RLTrainer

    prepare("code", None, tmp_path / "code")
    marker = uuid.uuid4().hex
    reward_file = tmp_path / "hostile_reward.py"
    reward_file.write_text(HOSTILE_REWARD.replace("MARKER", marker))
    cfg = load_config(None, [
        "algorithm.adv_estimator=grpo", f"data.train_files={tmp_path / 'code' / 'train.parquet'}",
        "data.train_batch_size=4", "data.max_prompt_length=512", "data.max_response_length=8",
        "data.filter_overlong_prompts=True", f"actor_rollout_ref.model.path={tiny_model_dir}",
        "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "actor_rollout_ref.model.enable_gradient_checkpointing=False", "reward_model.num_workers=2",
        "reward_model.code_sandbox.run_timeout=1", "reward_model.sandbox_fusion.memory_limit_mb=256",
        f"custom_reward_function.path={reward_file}",
        "trainer.total_training_steps=2", "trainer.logger=['jsonl']", "trainer.val_before_train=False",
        f"trainer.default_local_dir={tmp_path / 'run'}"])
    trainer = RLTrainer(cfg)
    trainer.fit()
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2]
    for m in metrics:
        assert "reward/pass_rate/mean" in m
        assert m.get("reward/errors", 0) == 0 and m.get("reward/timeouts", 0) == 0
        assert m["critic/score/max"] == 0.0  # hostile programs earn nothing (nor does the untrained model)
    assert not Path("/etc/posttrain-pwned").exists()
    procs = [p for p in Path("/proc").iterdir() if p.name.isdigit()]
    leftovers = []
    for p in procs:
        try:
            if marker.encode() in (p / "cmdline").read_bytes():
                leftovers.append(p.name)
        except OSError:
            pass
    assert not leftovers


def test_refusal_without_a_sandbox_and_the_unsafe_opt_in(monkeypatch):
    monkeypatch.setattr(sandbox, "_probe_result", (None, "bwrap cannot create a user namespace"))
    with pytest.raises(SandboxUnavailable) as err:
        run_program("print(1)")
    message = str(err.value)
    assert "bwrap cannot create a user namespace" in message and sandbox.OPT_IN_KEY + "=True" in message
    with pytest.raises(SandboxUnavailable):
        check_ready(["posttrain/code"], CodeSettings())
    check_ready(["openai/gsm8k"], CodeSettings())  # no code rows: nothing to refuse
    check_ready(["posttrain/code"], CodeSettings(url="http://127.0.0.1:9/run_code"))  # runs remotely
    monkeypatch.setattr(sandbox, "_warned", False)
    with pytest.warns(UserWarning, match="WITHOUT a sandbox"):
        result = run_program("print(6 * 7)", allow_unsandboxed=True, limits=Limits(wall_s=5.0))
    assert result.ok and result.stdout == "42\n" and not result.sandboxed
    loop = "```python\nwhile True:\n    pass\n```"
    assert compute_score(loop, '["assert True"]', None, CodeSettings(run_timeout=1.0, allow_unsandboxed=True)) == \
        {"score": 0.0, "acc": 0.0, "pass_rate": 0.0}


def test_settings_come_from_the_config_and_reach_spawned_scorers(tmp_path, monkeypatch):
    from posttrain.config import load_config
    from posttrain.reward import code

    monkeypatch.setenv(code._ENV, "")  # restored (unset) afterwards, as is the module's copy
    monkeypatch.setattr(code, "_settings", None)

    sf = "reward_model.sandbox_fusion"
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "train.parquet").write_bytes(b"")  # the rows' tests: hidden from programs
    cfg = load_config(None, [f"{sf}.url=http://h:1/run_code", f"{sf}.max_concurrent=3", f"{sf}.memory_limit_mb=300",
                             "reward_model.code_sandbox.run_timeout=2.5",
                             f"data.train_files={tmp_path / 'data' / 'train.parquet'}",
                             f"trainer.default_local_dir={tmp_path / 'run'}"])
    settings = code.configure_from_config(cfg)
    assert settings == CodeSettings(url="http://h:1/run_code", max_concurrent=3, memory_limit_mb=300, run_timeout=2.5,
                                    allow_unsandboxed=False, hide=(str(tmp_path / "run"), str(tmp_path / "data")))
    with multiprocessing.get_context("spawn").Pool(1) as pool:  # a fresh interpreter reads them from the environment
        assert pool.apply(code.current_settings) == settings
    for bad, message in (("reward_model.code_sandbox.run_timeout=0", "run_timeout must be positive"),
                         ("reward_model.sandbox_fusion.url=ftp://x", "must be an http")):
        with pytest.raises(ConfigError, match=message):
            load_config(None, [bad])


def test_training_on_code_refuses_before_its_first_step_without_a_sandbox(tmp_path, tiny_model_dir, monkeypatch):
    from posttrain.config import load_config
    from posttrain.trainer.rl import RLTrainer

    monkeypatch.setenv("POSTTRAIN_CODE_SANDBOX", "")
    monkeypatch.setattr(sandbox, "_probe_result", (None, "bwrap: setting up uid map: Permission denied"))
    prepare("code", None, tmp_path / "code")
    base = ["algorithm.adv_estimator=grpo", f"data.train_files={tmp_path / 'code' / 'test.parquet'}",
            "data.train_batch_size=2", "data.max_prompt_length=512", "data.max_response_length=4",
            "data.filter_overlong_prompts=True", f"actor_rollout_ref.model.path={tiny_model_dir}",
            "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
            "trainer.total_training_steps=1", "trainer.logger=['jsonl']",
            f"trainer.default_local_dir={tmp_path / 'run'}"]
    with pytest.raises(SandboxUnavailable, match=r"Permission denied.*allow_unsandboxed=True"):
        RLTrainer(load_config(None, base))
    RLTrainer(load_config(None, base + ["reward_model.code_sandbox.allow_unsandboxed=True"]))  # the opt-in starts
