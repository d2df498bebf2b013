"""Python callables named in settings by `module:function` or `path/to/file.py:function` (an agent program):
what tells them from a command line, and the import, with the reason when it fails."""

from __future__ import annotations

import importlib
import importlib.util
import re
import sys
from pathlib import Path
from typing import Callable

TARGET = re.compile(r"(?P<module>[A-Za-z_][\w.]*|[^\s:]+\.py):(?P<name>[A-Za-z_]\w*)")


def is_callable_target(spec: str) -> bool:
    """Whether `spec` names a Python callable (`module:function`, `file.py:function`) rather than a command line."""
    return TARGET.fullmatch(spec.strip()) is not None


def load_callable(spec: str) -> Callable:
    """The function `module:function` or `path/to/file.py:function` names; ValueError saying why it cannot be had."""
    match = TARGET.fullmatch(spec.strip())
    if match is None:
        raise ValueError(f"{spec!r} is not of the form module:function or path/to/file.py:function")
    where, name = match["module"], match["name"]
    path = Path(where).expanduser().resolve() if where.endswith(".py") else None
    if path is not None and not path.is_file():
        raise ValueError(f"{spec!r}: no file {path}")
    try:
        if path is not None:
            module_spec = importlib.util.spec_from_file_location(f"_posttrain_program_{path.stem}", path)
            module = importlib.util.module_from_spec(module_spec)
            sys.modules[module_spec.name] = module  # dataclasses and pickling look modules up by name
            module_spec.loader.exec_module(module)
        else:
            module = importlib.import_module(where)
    except (Exception, SystemExit) as e:  # whatever the user's module raises while it imports
        raise ValueError(f"{spec!r}: importing {where} failed: {type(e).__name__}: {e}") from None
    fn = getattr(module, name, None)
    if fn is None:
        raise ValueError(f"{spec!r}: {where} has no {name!r}")
    if not callable(fn):
        raise ValueError(f"{spec!r}: {name} is a {type(fn).__name__}, not a function")
    return fn
