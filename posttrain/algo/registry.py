"""Name -> function registries, so configs pick algorithms by name and users can add their own."""

from __future__ import annotations

import difflib
import inspect
from typing import Callable, Generic, TypeVar

F = TypeVar("F", bound=Callable)


class Registry(Generic[F]):
    """A named table of functions with a decorator for registration and helpful lookup errors."""

    def __init__(self, kind: str):
        self.kind = kind
        self._table: dict[str, F] = {}

    def register(self, *names: str, override: bool = False) -> Callable[[F], F]:
        """Decorator adding `fn` under `names`; a name already taken raises unless `override=True`, so a user's
        function never silently replaces a built-in one (and the metadata that travels with it)."""
        if not names:
            raise ValueError(f"register a {self.kind} under at least one name")
        if not override:
            self.check_free(*names)

        def decorate(fn: F) -> F:
            for name in names:
                self._table[name] = fn
            return fn

        return decorate

    def check_free(self, *names: str) -> None:
        taken = [n for n in names if n in self._table]
        if taken:
            raise ValueError(f"{self.kind} {taken} is already registered; pass override=True to replace it")

    def get(self, name: str) -> F:
        try:
            return self._table[name]
        except KeyError:
            close = difflib.get_close_matches(name, self._table, n=1)
            hint = f" Did you mean '{close[0]}'?" if close else ""
            raise KeyError(f"unknown {self.kind} '{name}'.{hint} Known: {sorted(self._table)}") from None

    def __contains__(self, name: str) -> bool:
        return name in self._table

    def names(self) -> list[str]:
        return sorted(self._table)


def check_signature(fn, positional: tuple, keywords: tuple, kind: str) -> None:
    """Reject a function whose parameters differ from the calling convention (no **kwargs swallowing typos)."""
    params = inspect.signature(fn).parameters.values()
    pos = tuple(p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD))
    kw = tuple(p.name for p in params if p.kind == p.KEYWORD_ONLY)
    rest = [p.name for p in params if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    if pos != positional or set(kw) != set(keywords) or rest:
        want = ", ".join(list(positional) + (["*"] + list(keywords) if keywords else []))
        raise TypeError(f"{kind} {fn.__name__} must have the signature ({want}); got {inspect.signature(fn)}")
