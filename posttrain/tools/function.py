"""Plain Python functions as tools: `@function_tool` in the file `multi_turn.function_tool_path` names.

The schema the model sees comes from the function's signature and Google-style docstring (`Args:` describing every
parameter, a type hint on each), through `transformers.utils.get_json_schema`, as verl's function tools do. The
function may be sync or async and returns a `str`, a `dict` (sent as JSON), or `(response, reward[, metrics])`.
Function tools are stateless: per-episode state needs a stateful tool (stateful.py).
"""

from __future__ import annotations

import importlib.util
import inspect
import os
import sys
from dataclasses import dataclass
from typing import Callable

from ..data.verl_compat import verl_imports_answered

_MARK = "__posttrain_tool__"


class ToolLoadError(ValueError):
    """A tool file or tool config that cannot be used, with the reason."""


@dataclass
class FunctionTool:
    name: str
    fn: Callable
    schema: dict  # OpenAI function schema: {"type": "function", "function": {name, description, parameters}}


def function_tool(name: str | Callable | None = None, *, schema: dict | None = None):
    """Mark a function as a tool: `@function_tool`, `@function_tool("other_name")`, or `@function_tool(schema=...)`
    to give the schema instead of inferring it. The function itself is returned unchanged (still callable)."""
    def mark(fn: Callable, tool_name: str | None = None):
        tool_name = tool_name or fn.__name__
        built = dict(schema) if schema is not None else schema_of(fn, tool_name)
        setattr(fn, _MARK, FunctionTool(tool_name, fn, built))
        return fn

    if callable(name):
        return mark(name)
    return lambda fn: mark(fn, name)


def schema_of(fn: Callable, name: str) -> dict:
    """The OpenAI function schema of `fn` from its signature and docstring."""
    from transformers.utils import get_json_schema

    variadic = [p.name for p in inspect.signature(fn).parameters.values()
                if p.kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)]
    if variadic:
        raise ValueError(f"tool {name!r} takes *{variadic[0]}: a tool schema names each parameter, so a tool "
                         "function takes named parameters only")
    raw = get_json_schema(fn)
    raw["function"].pop("return", None)
    raw["function"]["name"] = name
    return raw


def load_function_tools(path: str) -> list[FunctionTool]:
    """The `@function_tool` functions of the Python file at `path`, in the order defined."""
    full = os.path.abspath(os.path.expanduser(path))
    if not os.path.isfile(full):
        raise ToolLoadError(f"multi_turn.function_tool_path: no file at {path}")
    module_name = "posttrain_function_tools_" + "".join(c if c.isalnum() else "_" for c in full)
    spec = importlib.util.spec_from_file_location(module_name, full)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # so the file's own dataclasses and pickles find it
    try:
        with verl_imports_answered():  # `from verl.tools.function_tool import function_tool`: this module's
            spec.loader.exec_module(module)
    except Exception as e:
        del sys.modules[module_name]
        raise ToolLoadError(f"multi_turn.function_tool_path {path} failed to load: {type(e).__name__}: {e}") from e
    tools = [getattr(value, _MARK) for value in vars(module).values() if hasattr(value, _MARK)]
    if not tools:
        raise ToolLoadError(f"multi_turn.function_tool_path {path} defines no tool: mark each tool function with "
                            "@posttrain.tools.function_tool")
    return tools
