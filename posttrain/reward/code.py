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
returned dict also carries `pass_rate`, the fraction of tests passed. Stdin tests run one program each and stop at the
first failure (later tests count as failed); function/assert/checker tests run in one program, and a pass counts only
when the program's report carries a per-run secret, so code that exits early cannot fake a pass.
"""

from __future__ import annotations

import json
import os
import re
import secrets
from dataclasses import asdict, dataclass

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
                            hide=(os.path.abspath(run_dir),))
    configure(settings)
    return settings


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


# Runs after the response's code, in its namespace; prints "<secret> passed total" as its last act.
_HARNESS = '''
def __posttrain_tests(__cases, __kind, __name, __secret, __setup, __check):
    import json as __json
    __g = globals()
    __passed = 0
    if __setup:
        exec(__setup, __g)
    if __kind == "call":
        __fn = __g.get(__name)
        if __fn is None and "Solution" in __g:
            __fn = getattr(__g["Solution"](), __name, None)
        for __args, __want in __cases:
            try:
                __got = __fn(*__args)
                if isinstance(__got, tuple):
                    __got = list(__got)
                __got = __json.loads(__json.dumps(__got))
                __ok = __got == __want or (isinstance(__want, list) and len(__want) == 1 and __got == __want[0])
            except BaseException:
                __ok = False
            __passed += bool(__ok)
    elif __kind == "assert":
        for __src in __cases:
            try:
                exec(__src, __g)
                __passed += 1
            except BaseException:
                pass
    else:
        try:
            exec(__check, __g)
            __g["check"](__g[__name])
            __passed = 1
        except BaseException:
            pass
    print("\\n" + __secret, __passed, flush=True)
'''


def _harness_program(code: str, tests: Tests, secret: str) -> str:
    if tests.kind == "call":
        cases = [(x if isinstance(x, list) else [x], y) for x, y in zip(tests.inputs, tests.outputs)]
        name = tests.fn_name
    elif tests.kind == "assert":
        cases, name = list(tests.asserts), ""
    else:
        cases, name = [], tests.entry_point
    call = (f"__posttrain_tests(__import__('json').loads({json.dumps(json.dumps(cases))}), {tests.kind!r}, "
            f"{name!r}, {secret!r}, {tests.setup!r}, {tests.check!r})")
    # Imported rather than run, as the familiar harnesses do: an `if __name__ == "__main__":` block stays quiet.
    return f"__name__ = 'solution'\n{code}\n\n__name__ = '__main__'\n{_HARNESS}\n{call}\n"


def _passed_from_report(result: RunResult, secret: str) -> int:
    for line in reversed(result.stdout.splitlines()):
        parts = line.split()
        if len(parts) == 2 and parts[0] == secret and parts[1].isdigit():
            return int(parts[1])
    return 0


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
    else:
        secret = secrets.token_hex(16)
        result = execute(_harness_program(code, tests, secret), language, "", settings)
        passed = _passed_from_report(result, secret) if result.ok else 0
    rate = passed / tests.count
    return {"score": float(rate == 1.0), "acc": float(rate == 1.0), "pass_rate": rate}


def score_code(solution_str: str, ground_truth, extra_info: dict | None = None) -> dict:
    """The registry's scorer for code data sources (settings from `configure`)."""
    return compute_score(solution_str, ground_truth, extra_info)
