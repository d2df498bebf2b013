"""reasoning-gym tasks (data_source `reasoning_gym/<task>`): each response is graded by the task's own checker.

reasoning-gym (an optional extra: `pip install 'posttrain[reasoning-gym]'`) generates problems procedurally and
grades answers with `dataset.score_answer(answer, entry)`. A row written by `posttrain prepare reasoning-gym` carries
its whole entry (question, answer, metadata) and the options its dataset was built with, so the scorer rebuilds
both and needs nothing else: no generated file, no network. The answer is what reasoning-gym's own prompts ask for,
the text of the last `<answer>...</answer>` (reasoning_gym.utils.extract_answer); no tags, no answer.

Entries hold tuples and dicts with integer keys, which JSON would turn into lists and string keys, changing what
some checkers compare (arc_agi grids, graph_color colourings). `encode_entry` keeps them as tagged JSON that
`decode_entry` turns back into the same Python values.
"""

from __future__ import annotations

import difflib
import functools
import json

PREFIX = "reasoning_gym/"
INSTALL_HINT = "pip install 'posttrain[reasoning-gym]' (or: pip install reasoning-gym)"
_TUPLE, _ITEMS = "__tuple__", "__items__"


def _library():
    try:
        import reasoning_gym
    except ImportError as e:
        raise ImportError(f"reasoning-gym tasks need the reasoning_gym package, which is not installed ({e}); "
                          f"{INSTALL_HINT}") from None
    return reasoning_gym


def task_names() -> list[str]:
    """The tasks reasoning_gym can generate (its dataset registry)."""
    _library()
    from reasoning_gym.factory import DATASETS

    return sorted(DATASETS)


def require_task(task: str) -> None:
    """Raise a clear error when reasoning_gym is missing or has no task of this name (naming the close ones)."""
    _library()
    names = task_names()
    if task not in names:
        close = difflib.get_close_matches(task, names, n=3, cutoff=0.6)
        hint = f"did you mean {', '.join(close)}? " if close else ""
        raise ValueError(f"unknown reasoning-gym task {task!r}: {hint}the {len(names)} tasks are {', '.join(names)}")


def require_source(data_source: str) -> None:
    """`require_task` for a data_source `reasoning_gym/<task>` (checked before training starts)."""
    require_task(data_source[len(PREFIX):])


# ---------------------------------------------------------------- entries as JSON

def _encode(value):
    if isinstance(value, tuple):
        return {_TUPLE: [_encode(v) for v in value]}
    if isinstance(value, list):
        return [_encode(v) for v in value]
    if isinstance(value, dict):
        if all(isinstance(k, str) for k in value) and _TUPLE not in value and _ITEMS not in value:
            return {k: _encode(v) for k, v in value.items()}
        return {_ITEMS: [[_encode(k), _encode(v)] for k, v in value.items()]}
    if value is None or isinstance(value, (str, bool, int, float)):
        return value
    raise TypeError(f"a {type(value).__name__} value ({value!r:.60}) cannot be kept in a data row")


def _decode(value):
    if isinstance(value, list):
        return [_decode(v) for v in value]
    if isinstance(value, dict):
        if len(value) == 1 and _TUPLE in value:
            return tuple(_decode(v) for v in value[_TUPLE])
        if len(value) == 1 and _ITEMS in value:
            return {_decode(k): _decode(v) for k, v in value[_ITEMS]}
        return {k: _decode(v) for k, v in value.items()}
    return value


def encode_entry(entry: dict) -> str:
    """An entry (or any value of str / number / bool / None / list / tuple / dict) as a JSON string that
    `decode_entry` turns back into an equal value of the same types."""
    return json.dumps(_encode(entry), ensure_ascii=False)


def decode_entry(text: str):
    return _decode(json.loads(text))


# ---------------------------------------------------------------- scoring

@functools.lru_cache(maxsize=32)
def _dataset(task: str, options_json: str):
    """The task's dataset built as `prepare` built it (its options and seed), kept per process, with size 1: a
    checker reads the entry it is given, and some tasks generate all `size` problems when built (acre: over 15 s
    for 10,000)."""
    require_task(task)
    return _library().create_dataset(task, **{**json.loads(options_json), "size": 1})


def extract_answer(solution_str: str) -> str | None:
    """The last `<answer>...</answer>` of a response, stripped (reasoning-gym's rule), or None."""
    _library()
    from reasoning_gym.utils import extract_answer as rg_extract

    return rg_extract(solution_str)


def score_reasoning_gym(solution_str: str, ground_truth: str, extra_info: dict | None = None) -> dict:
    """The task checker's score of the response's `<answer>` (0 when it has none); `acc` is 1 only for a full
    score (a checker may give partial credit). The checker's exceptions propagate: the reward manager scores
    them 0 and counts them in reward/errors."""
    info = extra_info or {}
    missing = [k for k in ("task", "entry", "options") if not isinstance(info.get(k), str)]
    if missing:
        raise ValueError(f"a reasoning_gym row needs extra_info {missing} (strings), as `posttrain prepare "
                         f"reasoning-gym` writes them; got extra_info keys {sorted(info)}")
    dataset = _dataset(info["task"], info["options"])
    score = float(dataset.score_answer(extract_answer(solution_str), decode_entry(info["entry"])))
    return {"score": score, "acc": float(score == 1.0)}
