"""What a tool's answer becomes: the checks on a call's arguments, the reading of what a tool returned, and the
truncation of long answers (verl's `max_tool_response_length` / `tool_response_truncate_side`)."""

from __future__ import annotations

import json
import math

TRUNCATE_SIDES = ("left", "right", "middle")
_JSON_TYPES = {"string": (str,), "integer": (int,), "number": (int, float), "boolean": (bool,), "array": (list,),
               "object": (dict,), "null": (type(None),)}


class BadReturn(ValueError):
    """A tool returned something that is not an answer."""


def argument_problem(arguments: dict, parameters: dict | None) -> str | None:
    """Why `arguments` do not fit a function's JSON-schema `parameters` (missing, unknown or wrong-typed), or None."""
    parameters = parameters or {}
    properties = parameters.get("properties") or {}
    missing = [name for name in parameters.get("required") or [] if name not in arguments]
    if missing:
        return f"missing required argument(s) {missing}"
    unknown = sorted(set(arguments) - set(properties))
    if unknown and not parameters.get("additionalProperties"):
        return f"unknown argument(s) {unknown}; the tool takes {sorted(properties)}"
    for name, value in arguments.items():
        spec = properties.get(name) or {}
        expected = spec.get("type")
        if expected is None:
            continue
        names = [expected] if isinstance(expected, str) else list(expected)
        if spec.get("nullable"):
            names.append("null")
        if not any(_is(value, t) for t in names):
            return f"argument {name!r} must be {' or '.join(names)}, got {type(value).__name__} {value!r:.60}"
        if "enum" in spec and value not in spec["enum"]:
            return f"argument {name!r} must be one of {spec['enum']}, got {value!r:.60}"
    return None


def _is(value, json_type: str) -> bool:
    types = _JSON_TYPES.get(json_type)
    if types is None:
        return True  # a type this check does not know is not held against the call
    if isinstance(value, bool) and json_type in ("integer", "number"):
        return False
    return isinstance(value, types)


def read_return(value) -> tuple[str, float, dict]:
    """(text, reward, metrics) from what a tool returned: a str, a dict (as JSON), an object with `.text` (verl's
    ToolResponse), or a tuple (response, reward[, metrics]) of those; None reward / metrics count as 0 / {}."""
    if isinstance(value, tuple):
        if not 1 <= len(value) <= 3:
            raise BadReturn(f"a tuple of {len(value)} items (expected (response, reward[, metrics]))")
        reward = value[1] if len(value) > 1 and value[1] is not None else 0.0
        metrics = value[2] if len(value) > 2 and value[2] is not None else {}
        if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward):
            raise BadReturn(f"a reward that is not a finite number ({reward!r:.60})")
        if not isinstance(metrics, dict):
            raise BadReturn(f"metrics that are a {type(metrics).__name__}, not a dict")
        return _text(value[0]), float(reward), metrics
    return _text(value), 0.0, {}


def _text(response) -> str:
    if isinstance(response, str):
        return response
    if isinstance(response, dict):
        try:
            return json.dumps(response, ensure_ascii=False)
        except (TypeError, ValueError) as e:
            raise BadReturn(f"a dict that is not JSON ({e})") from None
    text = getattr(response, "text", 0)  # verl's ToolResponse; its text may be None (no text)
    if getattr(response, "image", None) or getattr(response, "video", None):
        raise BadReturn("images or video (verl's ToolResponse.image / .video): tool answers reach the model as "
                        "text only here")
    if response is not None and (text is None or isinstance(text, str)):
        return text or ""
    raise BadReturn(f"a {type(response).__name__} ({response!r:.60}); a tool returns str, dict, or "
                    "(response, reward[, metrics])")


def truncate(text: str, max_length: int | None, side: str) -> tuple[str, bool]:
    """`text` cut to `max_length` characters on `side`, marked as verl marks it; (text, whether it was cut)."""
    if max_length is None or len(text) <= max_length:
        return text, False
    if side == "left":
        return "(truncated)..." + text[len(text) - max_length:], True
    if side == "right":
        return text[:max_length] + "...(truncated)", True
    if side == "middle":
        half = max_length // 2
        return text[:half] + "...(truncated)..." + (text[len(text) - half:] if half else ""), True
    raise ValueError(f"tool_response_truncate_side must be one of {TRUNCATE_SIDES}, got {side!r}")
