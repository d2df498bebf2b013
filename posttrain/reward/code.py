"""Code rewards: run the response's program against the row's tests in the sandbox.

Ground truth (a JSON string or a dict) in one of the layouts code-RL datasets use:
  * stdin/stdout pairs (APPS, CodeContests, TACO):   {"inputs": ["1 2\\n", ...], "outputs": ["3\\n", ...]}
  * function calls (APPS/TACO call-based, LeetCode): {"fn_name": "add", "inputs": [[1, 2], ...], "outputs": [3, ...]}
    (each input is the argument list; a method of `class Solution` is found too)
  * assert statements (MBPP):  {"test_list": ["assert add(1, 2) == 3", ...], "test_setup_code": "..."} or a JSON list
    of assert strings, or {"assert": [...]}
  * a checker (HumanEval):     {"test": "def check(candidate): ...", "entry_point": "add"}
The language is the row's `extra_info["language"]` (or a "language" key of the ground truth); Python is the default
and the only language run so far, any other is rejected. The program is the last ```python block of the response
(```py and ```python3 too; an unclosed last block runs to the end), or the whole response when it has none.

Score: 1.0 when every test passes, else 0.0 (all-pass, like verl's prime code scorer with continuous=False); the
returned dict also carries `pass_rate`, the fraction of tests passed.

Verdicts are reached where the solution's code does not run, on plain data (plain_data.py) that crossed out of its
process, so nothing it can rebind, read or print decides a pass:
  * stdin tests: one run per test (stopping at the first failure); its stdout is compared here.
  * function-call tests: one run of the solution's program (sandbox_harness.answer_calls) that gets only the argument
    lists and writes each return value as plain data; the values are compared with the expected ones here.
  * assert and checker tests: the tests run for real in the judge's program (sandbox_harness.judge), which holds the
    tests and no solution code; the functions they call are proxies answered with the return values the solution's
    program gave for the same arguments (asked first for the calls written with literal arguments, then for those
    the judge meets, round by round). A test passes when its asserts hold on those values.
The expected values never enter the solution's process. What that process writes out is only a claim about what
its functions returned: forged lines, an always-true `__eq__`, a rebound `exec` or `bool`, an early exit, all come
down to values that are compared where it cannot reach (docs/reliability.md, "Code the model writes"). A call or
return value that is not plain data (a function, a user class instance), a test that reads arguments the solution
changed in place, names the tests use that the solution defines as something other than a function, and a test
still undecided after MAX_ROUNDS fail the test. A checker that calls a helper it does not define (HumanEval's
`poly`) gets the solution's version of it, as before.
"""

from __future__ import annotations

import ast
import builtins
import functools
import json
import os
import re
import secrets
from dataclasses import asdict, dataclass
from pathlib import Path

from . import plain_data
from .sandbox import Limits, RunResult, run_program

DATA_SOURCES = ("posttrain/code", "code", "codecontests", "apps", "codeforces", "taco", "mbpp", "humaneval")
_ENV = "POSTTRAIN_CODE_SANDBOX"  # carries the settings into scorer processes started by spawn/forkserver
_FENCE = re.compile(r"```(?:python3?|py)[ \t]*\n", re.IGNORECASE)


@dataclass(frozen=True)
class CodeSettings:
    """How code is run: `url` set -> a SandboxFusion-compatible server; else the local bubblewrap sandbox."""

    url: str | None = None
    max_concurrent: int = 64
    memory_limit_mb: int = 1024
    run_timeout: float = 5.0
    allow_unsandboxed: bool = False
    hide: tuple = ()  # folders programs must not see besides the home folders and the current one: the run folder


_settings: CodeSettings | None = None


def configure(settings: CodeSettings) -> None:
    """Set how this process and scorer processes started after it run code."""
    global _settings
    _settings = settings
    os.environ[_ENV] = json.dumps(asdict(settings))


def configure_from_config(cfg) -> CodeSettings:
    """The settings from a run's config (`reward_model.sandbox_fusion.*`, `reward_model.code_sandbox.*`)."""
    sf, cs, tr = cfg.reward_model.sandbox_fusion, cfg.reward_model.code_sandbox, cfg.trainer
    run_dir = tr.default_local_dir or f"checkpoints/{tr.project_name}/{tr.experiment_name}"  # as the trainer's
    settings = CodeSettings(url=sf.url, max_concurrent=sf.max_concurrent, memory_limit_mb=sf.memory_limit_mb,
                            run_timeout=cs.run_timeout, allow_unsandboxed=cs.allow_unsandboxed,
                            hide=(os.path.abspath(run_dir), *_data_folders(cfg.data)))
    configure(settings)
    return settings


def _data_folders(data) -> list[str]:
    """The folders of the run's local data files: they hold every row's tests, expected outputs included."""
    files = []
    for key in ("train_files", "val_files"):
        value = getattr(data, key, None)
        files += [value] if isinstance(value, str) else list(value or [])
    paths = [os.path.abspath(os.path.expanduser(f)) for f in files]
    return sorted({os.path.dirname(p) for p in paths if os.path.exists(p)})


def current_settings() -> CodeSettings:
    if _settings is not None:
        return _settings
    raw = os.environ.get(_ENV)
    if not raw:
        return CodeSettings()
    fields = json.loads(raw)
    return CodeSettings(**{**fields, "hide": tuple(fields.get("hide") or ())})


def check_ready(data_sources, settings: CodeSettings | None = None) -> None:
    """Before training: refuse (SandboxUnavailable, saying what to do) when code rows would need a local sandbox
    that cannot start and running unsandboxed was not allowed."""
    from .sandbox import SandboxUnavailable, _refusal, sandbox_status

    settings = settings or current_settings()
    if settings.url or settings.allow_unsandboxed or not any(s in DATA_SOURCES for s in set(data_sources)):
        return
    usable, why = sandbox_status()
    if not usable:
        raise SandboxUnavailable(_refusal(why))


def extract_code(text: str) -> str:
    """The last ```python block of a response (up to its closing fence, or to the end when the response was cut
    off inside it), or the whole response when it has none."""
    opening = None
    for opening in _FENCE.finditer(text):
        pass
    if opening is None:
        return text
    return text[opening.end():].split("```", 1)[0]


@dataclass
class Tests:
    kind: str  # "stdio" | "call" | "assert" | "check"
    inputs: list
    outputs: list
    fn_name: str = ""
    asserts: tuple = ()
    setup: str = ""
    check: str = ""
    entry_point: str = ""
    language: str = "python"

    @property
    def count(self) -> int:
        return {"stdio": len(self.inputs), "call": len(self.inputs), "assert": len(self.asserts), "check": 1}[self.kind]


def parse_tests(ground_truth) -> Tests:
    """The tests of a ground truth in any of the accepted layouts (module docstring); ValueError names the layouts."""
    gt = ground_truth
    if isinstance(gt, (bytes, str)):
        try:
            gt = json.loads(gt)
        except json.JSONDecodeError:
            gt = [line for line in str(ground_truth).splitlines() if line.strip().startswith("assert")] or gt
    language = gt.get("language", "python") if isinstance(gt, dict) else "python"
    if isinstance(gt, list) and gt and all(isinstance(a, str) for a in gt):
        return Tests("assert", [], [], asserts=tuple(gt), language=language)
    if isinstance(gt, dict):
        asserts = gt.get("test_list", gt.get("assert"))
        if isinstance(asserts, list) and asserts:
            setup = "\n".join(filter(None, [gt.get("test_setup_code") or "", *(gt.get("test_imports") or [])]))
            return Tests("assert", [], [], asserts=tuple(asserts), setup=setup, language=language)
        if isinstance(gt.get("test"), str) and gt.get("entry_point"):
            return Tests("check", [], [], check=gt["test"], entry_point=gt["entry_point"], language=language)
        inputs, outputs = gt.get("inputs"), gt.get("outputs")
        if isinstance(inputs, list) and isinstance(outputs, list) and inputs and len(inputs) == len(outputs):
            if gt.get("fn_name"):
                return Tests("call", inputs, outputs, fn_name=gt["fn_name"], language=language)
            if all(isinstance(x, str) for x in inputs + outputs):
                return Tests("stdio", inputs, outputs, language=language)
    raise ValueError("code ground truth not understood: expected {'inputs': [...], 'outputs': [...]} (stdin/stdout), "
                     "the same with 'fn_name', {'test_list': [assert ...]}, a list of assert strings, or "
                     f"{{'test': 'def check(candidate): ...', 'entry_point': name}}; got {str(ground_truth)[:120]!r}")


def same_output(got: str, expected: str) -> bool:
    """Token-wise equality: whitespace and line-ending differences are not failures (as judges compare)."""
    return got.split() == expected.split()


_HERE = Path(__file__).parent
MAX_ROUNDS = 6  # judge runs for assert and checker tests (calls that depend on earlier results need more)


@functools.lru_cache(maxsize=None)
def _program(start: str) -> str:
    """The text of a sandboxed harness program: the plain-data codec, the harness, and the line that starts it."""
    return "\n".join([(_HERE / "plain_data.py").read_text(), (_HERE / "sandbox_harness.py").read_text(),
                      f"{start}()\n"])


def _results(result: RunResult, tag: str) -> list:
    """The harness's result lines of a run, as data (lines that are not well-formed are skipped)."""
    found = []
    for line in result.stdout.splitlines():
        head, _, body = line.partition(" ")
        if head == tag:
            try:
                found.append(plain_data.loads(body))
            except plain_data.NotPlain:
                pass
    return found


def _outcome(data) -> dict:
    """A well-formed outcome of one call, rebuilt from plain data, else an error outcome."""
    if isinstance(data, dict) and len(data) == 1:
        (kind, body), = data.items()
        try:
            if kind == "value":
                return {"value": plain_data.encode(plain_data.decode(body))}
        except plain_data.NotPlain as e:
            return {"error": str(e)}
        if kind == "raised" and isinstance(body, str) and body.isidentifier() and len(body) < 100:
            return {"raised": body}
    return {"error": "not an outcome"}


def _ask_solution(code: str, calls: list, setup: str, language: str,
                  settings: CodeSettings) -> tuple[bool, list[dict]]:
    """One run of the solution making `calls` ([name, encoded args, encoded kwargs]): whether it finished its job,
    and the outcome of each call (answered only when the run finished and gave exactly one outcome for it)."""
    tag = secrets.token_hex(8)  # tells result lines from the program's own prints; not a secret it cannot read
    job = {"tag": tag, "solution": code, "setup": setup, "calls": calls}
    result = execute(_program("answer_calls"), language, json.dumps(job), settings)
    lines = _results(result, tag)
    if ["done"] not in lines:
        return False, [{"error": "the program did not finish"}] * len(calls)
    by_call: dict[int, list] = {}
    for line in lines:
        if isinstance(line, list) and len(line) == 2 and type(line[0]) is int and 0 <= line[0] < len(calls):
            by_call.setdefault(line[0], []).append(line[1])
    return True, [_outcome(by_call[i][0]) if len(by_call.get(i, ())) == 1 else {"error": "not one answer"}
                  for i in range(len(calls))]


def _as_json(value):
    """A returned value as JSON would carry it (tuples as lists, dict keys as text), as function-call tests
    compare; None when JSON cannot carry it."""
    try:
        return json.loads(json.dumps(value))
    except (TypeError, ValueError):
        return None


def _call_passes(outcome: dict, expected) -> bool:
    if "value" not in outcome:
        return False
    got = _as_json(plain_data.decode(outcome["value"]))
    return got == expected or (isinstance(expected, list) and len(expected) == 1 and got == expected[0])


def _passed_calls(code: str, tests: Tests, language: str, settings: CodeSettings) -> int:
    """Function-call tests: the solution's program gets only the arguments; its return values are compared with
    the expected ones here."""
    calls = [[tests.fn_name, plain_data.encode(x if isinstance(x, list) else [x]), {"dict": []}]
             for x in tests.inputs]
    _, outcomes = _ask_solution(code, calls, "", language, settings)
    return sum(_call_passes(o, want) for o, want in zip(outcomes, tests.outputs))


def _literal_calls(tests: Tests) -> dict[str, list]:
    """The calls the tests make with literal arguments, found by reading them (never running them): asked of the
    solution before the judge's first run, so most rows need one run of each program."""
    try:
        tree = ast.parse(tests.check if tests.kind == "check" else "\n".join(tests.asserts))
        defined = {n.id for n in ast.walk(ast.parse(tests.setup)) if isinstance(n, ast.Name)}
    except (SyntaxError, ValueError, RecursionError):
        return {}
    calls = {}
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)):
            continue
        if tests.kind == "check":
            name = tests.entry_point if node.func.id == "candidate" else None
        else:
            name = node.func.id if node.func.id not in defined and not hasattr(builtins, node.func.id) else None
        try:
            if name is None or any(isinstance(a, ast.Starred) for a in node.args):
                continue
            args = [ast.literal_eval(a) for a in node.args]
            kwargs = {k.arg: ast.literal_eval(k.value) for k in node.keywords if k.arg is not None}
            if len(kwargs) < len(node.keywords):
                continue
            call = [name, plain_data.encode(args), plain_data.encode(kwargs)]
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):  # not a literal
            continue
        calls.setdefault(plain_data.call_key(*call), call)
    return calls


def _judge_round(job: dict, known: dict, language: str, settings: CodeSettings) -> tuple[dict, dict]:
    """One run of the judge's program: each reported test's status, and the calls it asked for (by key)."""
    tag = secrets.token_hex(8)
    result = execute(_program("judge"), language, json.dumps({**job, "tag": tag, "known": list(known.items())}),
                     settings)
    verdicts, asked = {}, {}
    for line in _results(result, tag):  # the judge's program runs no solution code: its lines are its own
        number, status, calls = line if isinstance(line, list) and len(line) == 3 else (None, "", [])
        verdicts[number] = status
        if status == "incomplete":
            for name, args, kwargs in calls:
                asked.setdefault(plain_data.call_key(name, args, kwargs), [name, args, kwargs])
    return verdicts, asked


def _passed_judged(code: str, tests: Tests, language: str, settings: CodeSettings) -> int:
    """Assert and checker tests: the solution's program answers the calls the tests make (those with literal
    arguments first), the judge's program runs the tests on those answers, asking for the calls it met that
    were not answered yet; until every test has a verdict, no new call is asked, or MAX_ROUNDS."""
    job = {"kind": tests.kind, "setup": tests.setup, "tests": list(tests.asserts), "check": tests.check,
           "entry_point": tests.entry_point}
    known: dict[str, dict] = {}
    loaded, verdicts, asked = False, {}, _literal_calls(tests)
    for _ in range(MAX_ROUNDS):
        if asked:
            finished, outcomes = _ask_solution(code, list(asked.values()), tests.setup, language, settings)
            loaded = loaded or finished
            known.update(zip(asked, outcomes))
        verdicts, asked = _judge_round(job, known, language, settings)
        asked = {key: call for key, call in asked.items() if key not in known}
        if not asked:
            break
    if not loaded:  # (tests that call nothing still need a program that loads and finishes)
        loaded, _ = _ask_solution(code, [], tests.setup, language, settings)
    return sum(status == "pass" for status in verdicts.values()) if loaded else 0


def execute(code: str, language: str, stdin: str, settings: CodeSettings) -> RunResult:
    """One program run, in the local sandbox or on the configured server."""
    if settings.url:
        from .sandbox_client import run_remote

        return run_remote(settings.url, code, language, stdin, run_timeout=settings.run_timeout,
                          memory_limit_mb=settings.memory_limit_mb, max_concurrent=settings.max_concurrent)
    limits = Limits(wall_s=settings.run_timeout, memory_mb=settings.memory_limit_mb)
    return run_program(code, language, stdin, limits, allow_unsandboxed=settings.allow_unsandboxed,
                       hide=tuple(settings.hide))


def compute_score(solution_str: str, ground_truth, extra_info: dict | None = None,
                  settings: CodeSettings | None = None) -> dict:
    """{"score": all tests pass, "acc": same, "pass_rate": fraction passed} for one response."""
    settings = settings or current_settings()
    tests = parse_tests(ground_truth)
    language = (extra_info or {}).get("language") or tests.language
    from .sandbox import LANGUAGES

    if not isinstance(language, str) or language.lower() not in LANGUAGES:
        raise ValueError(f"unknown language {language!r} in a code row: the code sandbox runs {sorted(LANGUAGES)}")
    code = extract_code(solution_str)
    passed = 0
    if tests.kind == "stdio":
        for stdin, expected in zip(tests.inputs, tests.outputs):
            result = execute(code, language, stdin, settings)
            if not (result.ok and same_output(result.stdout, expected)):
                break
            passed += 1
    elif tests.kind == "call":
        passed = _passed_calls(code, tests, language, settings)
    else:
        passed = _passed_judged(code, tests, language, settings)
    rate = passed / tests.count
    return {"score": float(rate == 1.0), "acc": float(rate == 1.0), "pass_rate": rate}


def score_code(solution_str: str, ground_truth, extra_info: dict | None = None) -> dict:
    """The registry's scorer for code data sources (settings from `configure`)."""
    return compute_score(solution_str, ground_truth, extra_info)
