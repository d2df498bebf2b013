"""Tool calls in the policy's text, in one of two formats (`multi_turn.format`):

- `hermes`, as the Qwen2.5 / Qwen3 chat templates write them: `<tool_call>{"name": ..., "arguments": {...}}
  </tool_call>`, any number per turn. `arguments` may be a JSON string, as the Qwen templates accept; a missing
  `arguments` is `{}`.
- `gpt-oss`, OpenAI's harmony format (gpt-oss models, verl's `GptOssToolParser`), read from text decoded with its
  special tokens: a call is an assistant message whose recipient is `functions.NAME` and whose content is the
  arguments' JSON, `<|start|>assistant<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}
  <|call|>` (the recipient may also follow the role, `<|start|>assistant to=functions.NAME<|channel|>...`; the turn's
  first message has no `<|start|>assistant`, which the prompt ends with; `<|call|>` ends the turn, so the last call
  may end with the text). Messages of the `analysis` channel (the model's reasoning) are never read for calls, as
  verl removes them first.

Parsing never raises: a call the model wrote wrongly is a `ToolCall` with `error` set to a short kind, so it can be
answered (the model learns from the answer) and counted. Kinds: `malformed_json` (the body is not a JSON object),
`missing_name`, `bad_arguments` (arguments neither an object nor a JSON string of one), `unclosed_tag` (a
`<tool_call>` never closed), `nested_tag` (a `<tool_call>` inside another).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

OPEN, CLOSE = "<tool_call>", "</tool_call>"
FORMATS = ("hermes", "gpt-oss")
# How a call is written, for the answer to a call written wrongly
HOW_TO_CALL = {"hermes": f'{OPEN}{{"name": <tool name>, "arguments": {{...}}}}{CLOSE}',
               "gpt-oss": "<|start|>assistant<|channel|>commentary to=functions.<tool name> <|constrain|>json"
                          "<|message|>{...}<|call|>"}


@dataclass
class ToolCall:
    name: str | None
    arguments: dict | None
    raw: str  # the text between the tags (or after an unclosed one)
    error: str | None = None  # the kind of mistake, None for a well-formed call
    detail: str = ""  # what was wrong, in words (for the answer to the model)
    format: str = "hermes"  # the format it was read in


@dataclass
class ParsedTurn:
    content: str  # the turn's text without its tool-call blocks
    calls: list[ToolCall] = field(default_factory=list)


def parse_tool_calls(text: str, format: str = "hermes") -> ParsedTurn:
    """The calls of one assistant turn, in the order written."""
    if format not in FORMATS:
        raise ValueError(f"unknown tool-call format {format!r}: known formats are {list(FORMATS)}")
    if format == "gpt-oss":
        return _parse_harmony(text)
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


# A harmony message's header: an optional `<|start|>` and role (with an optional recipient), the channel (with an
# optional recipient and content type) up to `<|message|>`; its content runs to the message's end token, the next
# message's `<|start|>` or the text's end. An `analysis` message (reasoning) runs to its `<|end|>`, as verl cuts it,
# so a call written inside the reasoning is not read.
_HEADER = re.compile(r"(?:<\|start\|>(?P<role>[^<]*))?<\|channel\|>(?P<channel>[^<]*?)"
                     r"(?:<\|constrain\|>[^<]*)?<\|message\|>")
_BODY_END = re.compile(r"<\|end\|>|<\|call\|>|<\|return\|>|(?=<\|start\|>)")
_RECIPIENT = re.compile(r"(?:^|\s)to=(\S*)")


def _parse_harmony(text: str) -> ParsedTurn:
    calls, kept, at, pos = [], [], 0, 0
    while (header := _HEADER.search(text, pos)) is not None:
        channel = (header["channel"].split() or [""])[0]
        if channel == "analysis":
            end = text.find("<|end|>", header.end())
            pos = len(text) if end < 0 else end + len("<|end|>")
            continue
        stop = _BODY_END.search(text, header.end())
        body, pos = (text[header.end():stop.start()], stop.end()) if stop else (text[header.end():], len(text))
        recipient = next((r for r in _RECIPIENT.findall(f"{header['role'] or ''} {header['channel']}") if r), "")
        if not recipient.startswith("functions."):
            continue
        kept.append(text[at:header.start()])
        at = pos
        call = _harmony_call(recipient[len("functions."):], body.strip())
        call.format = "gpt-oss"
        calls.append(call)
    kept.append(text[at:])
    return ParsedTurn("".join(kept).strip(), calls)


def _harmony_call(name: str, body: str) -> ToolCall:
    if not name:
        return ToolCall(None, None, body, "missing_name", "the recipient names no function: write to=functions.NAME")
    try:
        arguments = json.loads(body) if body else {}
    except ValueError as e:
        return ToolCall(name, None, body, "malformed_json", f"the arguments are not valid JSON ({e})")
    if not isinstance(arguments, dict):
        return ToolCall(name, None, body, "bad_arguments",
                        f"the arguments must be a JSON object, got a JSON {type(arguments).__name__}")
    return ToolCall(name, arguments, body)
