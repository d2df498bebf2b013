"""Tool calls in the policy's text, in the hermes format the Qwen2.5 / Qwen3 chat templates write:
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any number per turn.

Parsing never raises: a call the model wrote wrongly is a `ToolCall` with `error` set to a short kind, so it can be
answered (the model learns from the answer) and counted. Kinds: `malformed_json` (the body is not a JSON object),
`missing_name`, `bad_arguments` (arguments neither an object nor a JSON string of one), `unclosed_tag` (a
`<tool_call>` never closed), `nested_tag` (a `<tool_call>` inside another). `arguments` may be a JSON string, as the
Qwen templates accept; a missing `arguments` is `{}`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

OPEN, CLOSE = "<tool_call>", "</tool_call>"
FORMATS = ("hermes",)


@dataclass
class ToolCall:
    name: str | None
    arguments: dict | None
    raw: str  # the text between the tags (or after an unclosed one)
    error: str | None = None  # the kind of mistake, None for a well-formed call
    detail: str = ""  # what was wrong, in words (for the answer to the model)


@dataclass
class ParsedTurn:
    content: str  # the turn's text without its tool-call blocks
    calls: list[ToolCall] = field(default_factory=list)


def parse_tool_calls(text: str, format: str = "hermes") -> ParsedTurn:
    """The calls of one assistant turn, in the order written."""
    if format not in FORMATS:
        raise ValueError(f"unknown tool-call format {format!r}: known formats are {list(FORMATS)}")
    calls, kept, at = [], [], 0
    while (start := text.find(OPEN, at)) != -1:
        kept.append(text[at:start])
        body_start = start + len(OPEN)
        end = text.find(CLOSE, body_start)
        if end == -1:
            body = text[body_start:]
            calls.append(ToolCall(None, None, body, "unclosed_tag", f"{OPEN} is never closed by {CLOSE}"))
            at = len(text)
            break
        body = text[body_start:end]
        if OPEN in body:
            calls.append(ToolCall(None, None, body, "nested_tag", f"a {OPEN} inside another {OPEN} block"))
        else:
            calls.append(_call(body))
        at = end + len(CLOSE)
    kept.append(text[at:])
    return ParsedTurn("".join(kept).strip(), calls)


def _call(body: str) -> ToolCall:
    try:
        obj = json.loads(body)
    except ValueError as e:
        return ToolCall(None, None, body, "malformed_json", f"the call is not valid JSON ({e})")
    if not isinstance(obj, dict):
        return ToolCall(None, None, body, "malformed_json", f"the call is a JSON {type(obj).__name__}, not an object")
    if "name" not in obj and isinstance(obj.get("function"), dict):  # {"function": {"name", "arguments"}}
        obj = obj["function"]
    name = obj.get("name")
    if not isinstance(name, str) or not name.strip():
        return ToolCall(None, None, body, "missing_name", 'the call has no "name" string')
    arguments = obj.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except ValueError as e:
            return ToolCall(name, None, body, "bad_arguments", f'"arguments" is a string that is not JSON ({e})')
    if arguments is None:
        arguments = {}
    if not isinstance(arguments, dict):
        return ToolCall(name, None, body, "bad_arguments",
                        f'"arguments" must be an object, got a JSON {type(arguments).__name__}')
    return ToolCall(name, arguments, body)
