"""MATH rule scorer: the last `\\boxed{...}` of a response, checked for mathematical equality with math-verify.

math-verify compares parsed expressions (so `\\frac12`, `0.5` and `\\dfrac{1}{2}` agree), which string matching cannot.
Its timeouts use `signal.alarm`, which works only in the main thread. The reward manager calls scorers in the main
thread or in worker processes (whose scoring also runs in their main thread), so the timeout normally applies; when
this scorer is called from any other thread it turns math-verify's timeout off instead of failing, and the caller
is responsible for bounding the time (the manager's worker processes have their own per-response limit).
"""

from __future__ import annotations

import math
import re
import threading

_BOX_CMD = re.compile(r"\\(boxed|fbox)")


def _braced(text: str, start: int) -> int | None:
    """Index just past the group that opens with `{` at `start`, or None when it never closes.

    A backslash escapes the next character, so `\\{` and `\\}` (literal braces, as in sets) do not count.
    """
    depth, i = 0, start
    while i < len(text):
        ch = text[i]
        if ch == "\\":
            i += 2
            continue
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    return None


def extract_boxed(text: str) -> str | None:
    """Content of the last top-level `\\boxed{...}` / `\\fbox{...}` / `\\boxed x` in `text`, or None.

    Scanning left to right and jumping over each box means `\\boxed{\\boxed{1}}` yields the outer box's content,
    and a later box always wins over an earlier one (models often restate the answer at the end).
    """
    if not text:
        return None
    found, pos = None, 0
    while True:
        m = _BOX_CMD.search(text, pos)
        if m is None:
            return found
        i = m.end()
        j = i
        while j < len(text) and text[j] in " \t":
            j += 1
        if text.startswith("{", j):
            end = _braced(text, j)
            if end is None:  # unclosed box: nothing after it can be trusted either
                return found
            found, pos = text[j + 1:end - 1].strip(), end
        elif m.group(1) == "boxed" and j > i:
            # `\boxed 5$`: the argument is the single token the TeX macro would take, up to `$` or end of line.
            arg = re.split(r"[$\n]", text[i:], maxsplit=1)[0].strip().rstrip(".").strip()
            if arg:
                found = arg
            pos = i + 1
        else:  # e.g. `\boxedanswer`: not a box command
            pos = i


def extract_answer(solution_str: str) -> str | None:
    """The boxed answer a response commits to, whitespace-normalised, for majority voting; None if there is none."""
    boxed = extract_boxed(solution_str)
    if boxed is None:
        return None
    return re.sub(r"\s+", " ", boxed).strip() or None


def _squash(text: str) -> str:
    return re.sub(r"\s+", "", text)


def compute_score(solution_str: str, ground_truth: str, timeout_s: float = 5.0) -> float:
    """1.0 when the response's last boxed answer equals `ground_truth` (per math-verify), else 0.0. Never raises."""
    try:
        answer = extract_boxed(solution_str)
        if answer is None or ground_truth is None:
            return 0.0
        truth = str(ground_truth).strip()
        if truth.startswith("\\boxed") or truth.startswith("\\fbox"):
            truth = extract_boxed(truth) or truth
        # Identical text is equal whatever math-verify makes of it (e.g. a word answer it cannot parse).
        if _squash(answer) == _squash(truth) and answer:
            return 1.0
        return 1.0 if is_equiv(answer, truth, timeout_s) else 0.0
    except Exception:  # a reward must never take training down: malformed input scores 0
        return 0.0


def is_equiv(answer: str, ground_truth: str, timeout_s: float = 5.0) -> bool:
    """Whether two bare answers (no `\\boxed`) are mathematically equal per math-verify, with no string shortcut.

    Raises only what math-verify raises; `compute_score` is the never-raising entry point.
    """
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

    # signal.alarm takes whole seconds and raises outside the main thread: turn the timeout off there.
    if threading.current_thread() is threading.main_thread() and timeout_s and timeout_s > 0:
        seconds = max(1, math.ceil(timeout_s))
    else:
        seconds = None
    configs = [LatexExtractionConfig(), ExprExtractionConfig()]
    # Re-boxing both sides makes math-verify read exactly the extracted answer, not other numbers around it.
    gold = parse(f"\\boxed{{{ground_truth}}}", extraction_config=configs, parsing_timeout=seconds)
    pred = parse(f"\\boxed{{{answer}}}", extraction_config=configs, parsing_timeout=seconds)
    if not gold or not pred:
        return False
    return bool(verify(gold, pred, timeout_seconds=seconds))
