"""Which rule scorer grades which row: dispatch on the row's `data_source`, plus user-supplied scorers.

Every row of the RL data layout names its `data_source`; routing on it lets one run mix datasets with different answer
conventions (`#### N` vs `\\boxed{}`). Users extend the table with `@register_scorer` or replace it wholesale with
`custom_reward_function.path/name` (loaded by `load_custom_reward_function`).
"""

from __future__ import annotations

import hashlib
import importlib.util
import sys
from pathlib import Path
from typing import Any, Callable

from . import code as _code
from . import gsm8k as _gsm8k
from . import math as _math
from . import rgym as _rgym
from . import tool_answer as _tool_answer

Scorer = Callable[[str, str, Any], "float | dict"]  # (solution_str, ground_truth, extra_info) -> score


class UnknownDataSourceError(KeyError):
    """No scorer is registered for a row's data_source; the message says how to add one."""

    def __str__(self) -> str:  # KeyError would print the message quoted (repr); keep it readable
        return str(self.args[0]) if self.args else ""


_SCORERS: dict[str, Scorer] = {}
_EXTRACTORS: dict[str, Callable[[str], "str | None"]] = {}
# Families of sources named `<prefix><task>` (reasoning_gym/chain_sum, ...): one scorer grades them all, and
# `check(source)` raises a clear error for a task the family does not have. An exact registration takes precedence.
_FAMILIES: dict[str, tuple[Scorer, Callable[[str], "str | None"], Callable[[str], None]]] = {
    _rgym.PREFIX: (_rgym.score_reasoning_gym, _rgym.extract_answer, _rgym.require_source)}


def register_scorer(*data_sources: str, extract_answer: Callable[[str], "str | None"] | None = None,
                    override: bool = False):
    """Decorator: grade rows of these data sources with `fn(solution_str, ground_truth, extra_info=None)`.

    `extract_answer`, when given, is what majority voting uses to read a response's final answer for these sources.
    A source that already has a scorer (a built-in one included) is replaced only with `override=True`.
    """
    if not data_sources or not all(isinstance(s, str) and s for s in data_sources):
        raise ValueError("register_scorer needs one or more non-empty data_source names, e.g. @register_scorer('foo')")
    taken = [s for s in data_sources if s in _SCORERS]
    if taken and not override:
        raise ValueError(f"data_source {taken} already has a scorer; pass override=True to replace it")

    def decorator(fn):
        if not callable(fn):
            raise TypeError(f"register_scorer: {fn!r} is not callable")
        for source in data_sources:
            _SCORERS[source] = fn
            if extract_answer is not None:
                _EXTRACTORS[source] = extract_answer
            else:
                _EXTRACTORS.pop(source, None)
        return fn

    return decorator


def known_data_sources() -> list[str]:
    """Sorted names that `default_compute_score` can grade (a family as `<prefix><task>`)."""
    return sorted([*_SCORERS, *(f"{prefix}<task>" for prefix in _FAMILIES)])


def _family(data_source) -> str | None:
    if isinstance(data_source, str) and data_source not in _SCORERS:
        return next((p for p in _FAMILIES if data_source.startswith(p) and len(data_source) > len(p)), None)
    return None


def _lookup(table: dict, data_source):
    """The scorer for a source: its own registration, else its family's."""
    try:
        return table[data_source]
    except (KeyError, TypeError):  # TypeError: an unhashable data_source cell
        family = _family(data_source)
        if family is None:
            raise _unknown(data_source) from None
        return _FAMILIES[family][0]


def require_scorer(data_source) -> None:
    """Raise before training when a source has no scorer: UnknownDataSourceError, or the family's own error (a
    reasoning-gym task that does not exist, the package not installed)."""
    family = _family(data_source)
    if family is not None:
        _FAMILIES[family][2](data_source)
    else:
        _lookup(_SCORERS, data_source)


def has_scorer(data_source) -> bool:
    """Whether `require_scorer` would pass (a reward model's manager scores rule-less sources itself)."""
    try:
        require_scorer(data_source)
    except (UnknownDataSourceError, ImportError, ValueError):
        return False
    return True


def _unknown(data_source: str) -> UnknownDataSourceError:
    return UnknownDataSourceError(
        f"no reward function for data_source {data_source!r}. Known: {known_data_sources()}. "
        "Add one with custom_reward_function.path=my_reward.py custom_reward_function.name=compute_score, "
        f"or register it with @posttrain.reward.register_scorer({data_source!r})")


def default_compute_score(data_source: str, solution_str: str, ground_truth: str,
                          extra_info: dict | None = None) -> float | dict:
    """Score one response with the scorer registered for its data_source (the reward manager's default)."""
    return _lookup(_SCORERS, data_source)(solution_str, ground_truth, extra_info)


def extract_answer_for(data_source: str, text: str) -> str | None:
    """A response's final answer as the source's scorer reads it (for majority voting); None if there is none."""
    family = _family(data_source)
    if family is not None:
        return _FAMILIES[family][1](text)
    _lookup(_SCORERS, data_source)
    extractor = _EXTRACTORS.get(data_source)
    if extractor is None:
        raise ValueError(f"the scorer for data_source {data_source!r} has no answer extractor; pass "
                         "extract_answer=... to @register_scorer to enable majority voting for it")
    return extractor(text)


def load_custom_reward_function(path: str | Path, name: str = "compute_score") -> Callable:
    """Import a Python file by path and return its function `name` (the `custom_reward_function` config keys)."""
    file = Path(path).expanduser()
    if not file.is_file():
        raise FileNotFoundError(f"custom_reward_function.path: reward file not found: {file.resolve()}")
    module_name = "posttrain_custom_reward_" + hashlib.sha1(str(file.resolve()).encode()).hexdigest()[:12]
    spec = importlib.util.spec_from_file_location(module_name, file)
    if spec is None or spec.loader is None:
        raise ImportError(f"custom_reward_function.path: cannot import {file} as a Python module (is it a .py file?)")
    module = importlib.util.module_from_spec(spec)
    # In sys.modules so the function pickles by reference: the reward manager's forked scorer workers inherit the
    # module and can look it up by name (and dataclasses defined in the file can find their module while it runs).
    sys.modules[module_name] = module
    from ..data.verl_compat import verl_imports_answered

    try:
        with verl_imports_answered():  # the verl modules posttrain supplies (a recipe's dataset base class)
            spec.loader.exec_module(module)
    except Exception:
        sys.modules.pop(module_name, None)
        raise
    fn = getattr(module, name, None)
    if fn is None:
        public = sorted(k for k, v in vars(module).items() if callable(v) and not k.startswith("_"))
        raise AttributeError(f"custom_reward_function.name: {file} has no function {name!r} "
                             f"(callables defined there: {public})")
    if not callable(fn):
        raise TypeError(f"custom_reward_function.name: {file}:{name} is a {type(fn).__name__}, not a function")
    return fn


class FileFunction:
    """`custom_reward_function.path/name` as a callable that pickles as (path, name): a scorer worker process
    imports the file itself (the importing process's module is not importable by name there)."""

    def __init__(self, path: str | Path, name: str = "compute_score"):
        self.path, self.name = str(Path(path).expanduser().resolve()), name
        self._fn = load_custom_reward_function(self.path, name)  # fails here, before training, when it is wrong

    def __call__(self, *args, **kwargs):
        if self._fn is None:
            self._fn = load_custom_reward_function(self.path, self.name)
        return self._fn(*args, **kwargs)

    def __getstate__(self):
        return {"path": self.path, "name": self.name}

    def __setstate__(self, state):
        self.path, self.name, self._fn = state["path"], state["name"], None

    def __repr__(self) -> str:
        return f"{self.path}:{self.name}"


class RegisteredScorers:
    """`default_compute_score` over a copy of the scorer table, for worker processes: they get the scorers
    registered in this process (by `@register_scorer` in the user's code too), each pickled by reference."""

    def __init__(self):
        self.table = dict(_SCORERS)

    def __call__(self, data_source: str, solution_str: str, ground_truth: str, extra_info: dict | None = None):
        return _lookup(self.table, data_source)(solution_str, ground_truth, extra_info)

    def __getstate__(self):
        import pickle

        for source, fn in self.table.items():
            try:
                pickle.dumps(fn)
            except Exception as e:
                raise TypeError(f"the scorer registered for data_source {source!r} ({fn!r}) cannot be sent to scorer "
                                f"worker processes ({e}); register a module-level function") from None
        return {"table": self.table}

    def __repr__(self) -> str:
        return f"<the scorers registered for {sorted(self.table)}>"


class BatchCall:
    """The `batch` reward manager's calling convention: one call for all rows, keyword lists in, a list out.
    Without a custom function, the registered scorers grade the rows one by one inside that call."""

    def __init__(self, fn: Callable | None):
        self.fn, self.rows = fn, (RegisteredScorers() if fn is None else None)

    def __call__(self, data_sources, solution_strs, ground_truths, extra_infos):
        if self.fn is None:
            return [self.rows(*row) for row in zip(data_sources, solution_strs, ground_truths, extra_infos)]
        return self.fn(data_sources=data_sources, solution_strs=solution_strs, ground_truths=ground_truths,
                       extra_infos=extra_infos)


def _gsm8k_strict(solution_str: str, ground_truth: str, extra_info: dict | None = None) -> float:
    return _gsm8k.compute_score(solution_str, ground_truth, method="strict")


def _math_verify(solution_str: str, ground_truth: str, extra_info: dict | None = None) -> float:
    return _math.compute_score(solution_str, ground_truth)


register_scorer("openai/gsm8k", "gsm8k", "synthetic/arithmetic",
                extract_answer=lambda text: _gsm8k.extract_answer(text, "strict"))(_gsm8k_strict)
register_scorer("DigitalLearningGmbH/MATH-lighteval", "lighteval/MATH", "HuggingFaceH4/MATH-500", "math", "math500",
                "hiyouga/geometry3k", "synthetic/visual-count",  # vision-language rows, answers in \boxed{}
                extract_answer=_math.extract_answer)(_math_verify)
register_scorer(*_code.DATA_SOURCES)(_code.score_code)
register_scorer("synthetic/calculator",  # data/synthetic_tools.py: the episode's final answer, an exact product
                extract_answer=lambda text: _tool_answer.extract_integer(_tool_answer.final_answer(text)))(
    _tool_answer.score_integer_answer)  # runs the response against the row's tests, sandboxed
