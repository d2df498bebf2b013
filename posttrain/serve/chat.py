"""From OpenAI messages to prompt ids, and from sampled ids back to text, tool calls and stream deltas.

- `render`: the tokenizer's chat template over the messages, with `tools=` and the generation prompt, as episodes
  render their first messages. An assistant message's `tool_calls` reach the template with `arguments` as an
  object (the OpenAI wire carries a JSON string; Qwen's templates write the object).
- `SampleText`: one sample's text as its tokens arrive. Text is detokenized incrementally (a window of the last
  tokens is decoded, and text that ends in an incomplete UTF-8 character waits for the next token), so a stream's
  deltas joined are the text of all its ids decoded at once. A stop string cuts the text where it starts; text
  that may be the start of a stop string (or of a tool call, when tools are offered) is held back until it is not.
- `tool_message`: the text of a finished sample as `content` + OpenAI `tool_calls` (hermes format,
  tools/parse.py). A turn with a malformed call is left as text: the client sees what the model wrote.
"""

from __future__ import annotations

import json
import uuid

from ..data.dataset import encode_prompt
from ..tools.parse import OPEN, parse_tool_calls


class ChatError(ValueError):
    """Messages the server cannot render (a 400)."""


def _text(content) -> str | None:
    """A message's content as text: a string, or the text parts of a list of parts (other parts are refused)."""
    if content is None or isinstance(content, str):
        return content
    parts = []
    for part in content:
        if part.get("type") != "text":
            raise ChatError(f"content parts of type {part.get('type')!r} are not supported (text only)")
        parts.append(part.get("text", ""))
    return "".join(parts)


def _arguments(arguments):
    """A tool call's arguments as the template writes them: a JSON object string becomes the object."""
    if isinstance(arguments, str):
        try:
            value = json.loads(arguments) if arguments.strip() else {}
        except ValueError:
            return arguments
        return value if isinstance(value, dict) else arguments
    return arguments


def template_messages(messages: list) -> list[dict]:
    """Protocol messages (protocol.Message) as the dicts a chat template reads."""
    out = []
    for m in messages:
        d = {"role": "system" if m.role == "developer" else m.role, "content": _text(m.content)}
        if m.name is not None:
            d["name"] = m.name
        if m.tool_call_id is not None:
            d["tool_call_id"] = m.tool_call_id
        if m.tool_calls:
            d["tool_calls"] = [{"id": c.id, "type": "function",
                                "function": {"name": c.function.name, "arguments": _arguments(c.function.arguments)}}
                               for c in m.tool_calls]
        if d["content"] is None and not m.tool_calls:
            d["content"] = ""
        out.append(d)
    return out


def render(tokenizer, messages: list, tools: list[dict] | None, template_kwargs: dict | None = None) -> list[int]:
    """Prompt ids: the chat template over `messages` (protocol.Message) with the generation prompt (and the
    request's `chat_template_kwargs`, e.g. Qwen3's enable_thinking)."""
    from ..data.rows import DataError

    try:
        return encode_prompt(tokenizer, template_messages(messages), template_kwargs, tools=tools or None,
                             where="the messages")
    except DataError as e:
        raise ChatError(str(e)) from None


def tool_message(text: str, tools_on: bool, format: str = "hermes") -> tuple[str | None, list[dict]]:
    """(content, tool_calls) of a finished turn. Without tools, or with a malformed call, the text as it is."""
    if not tools_on or OPEN not in text:
        return text, []
    turn = parse_tool_calls(text, format)
    if not turn.calls or any(c.error for c in turn.calls):
        return text, []
    calls = [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
              "function": {"name": c.name, "arguments": json.dumps(c.arguments, ensure_ascii=False)}}
             for c in turn.calls]
    return turn.content or None, calls


def _held(text: str, patterns: list[str]) -> int:
    """How many characters at the end of `text` may be the start of one of `patterns`."""
    longest = 0
    for p in patterns:
        for k in range(min(len(p) - 1, len(text)), longest, -1):
            if text.endswith(p[:k]):
                longest = k
                break
    return longest


class SampleText:
    """One sample's ids, log-probs and text as tokens arrive; see the module docstring.

    `push(token, logprob)` returns the text that may be sent now (""); `finish()` the rest. `stopped` turns True
    when a stop string matched (the text is cut at it; the caller cancels the sample and ignores later tokens).
    `watch` (e.g. `<tool_call>`): once it appears, nothing after it is sent before `finish` (tool_message parses it).
    `whole=True` (an answer sent whole, not streamed) with no stop strings: no text is needed before `finish`, which
    decodes every id at once (the same text; one decode per sample instead of two per token). `include_stop`: the
    text keeps the stop string it ended on; `skip_special=False`: special tokens are decoded as text too.
    """

    WINDOW = 6  # tokens decoded before the new ones, so a token's leading space or merged bytes come out right

    def __init__(self, tokenizer, stops: list[str] = (), watch: str | None = None, whole: bool = False,
                 include_stop: bool = False, skip_special: bool = True):
        self.tokenizer, self.stops, self.watch = tokenizer, list(stops), watch
        self.include_stop, self.skip_special = include_stop, skip_special
        self.incremental = not whole or bool(self.stops)  # False: its text is wanted at `finish` only
        self.ids: list[int] = []
        self.logprobs: list[float] = []
        self.tops: list[list | None] = []  # each token's top log-probs (processors.py), where the request asks
        self.text = ""  # decoded so far (cut at a stop string)
        self.sent = 0  # characters of `text` given out
        self.stopped = False
        self._prefix, self._read = 0, 0  # decode window: ids[_prefix:_read] gave text already in `text`

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special, clean_up_tokenization_spaces=False)

    def push(self, token: int, logprob: float, top: list | None = None) -> str:
        if self.stopped:  # sampled before the cancel reached the scheduler: not part of the answer
            return ""
        self.ids.append(token)
        self.logprobs.append(logprob)
        self.tops.append(top)
        if not self.incremental:
            return ""
        before = self._decode(self.ids[self._prefix:self._read])
        now = self._decode(self.ids[self._prefix:])
        if now.endswith("\ufffd") or len(now) <= len(before):  # an incomplete character, or no text
            return ""
        searched = max(0, len(self.text) - max((len(s) for s in self.stops), default=1))
        self.text += now[len(before):]
        self._prefix, self._read = max(0, len(self.ids) - self.WINDOW), len(self.ids)
        hits = [(i, i + len(s) if self.include_stop else i) for s in self.stops
                if (i := self.text.find(s, searched)) != -1]
        if hits:
            self.text, self.stopped = self.text[:min(hits)[1]], True
            return self._flush()
        return self._ready()

    def _ready(self) -> str:
        end = len(self.text) - _held(self.text, self.stops)
        if self.watch:
            at = self.text.find(self.watch)
            end = min(end, at if at != -1 else len(self.text) - _held(self.text, [self.watch]))
        if end <= self.sent:
            return ""
        out, self.sent = self.text[self.sent:end], end
        return out

    def _flush(self) -> str:
        """Everything not sent yet, except a watched block (which `tool_message` turns into calls)."""
        end = len(self.text)
        if self.watch and (at := self.text.find(self.watch)) != -1:
            end = at
        out, self.sent = self.text[self.sent:end], max(self.sent, end)
        return out

    def finish(self) -> str:
        if not self.stopped:
            self.text += self._decode(self.ids[self._prefix:])[len(self._decode(self.ids[self._prefix:self._read])):]
            self._read = len(self.ids)
        return self._flush()

    def tail(self) -> str:
        """The text from the watched block on (after `finish`)."""
        return self.text[self.sent:]
