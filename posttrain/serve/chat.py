"""From OpenAI messages to prompt ids, and from sampled ids back to text, tool calls and stream deltas.

- `render`: the tokenizer's chat template over the messages, with `tools=` and the generation prompt, as episodes
  render their first messages. An assistant message's `tool_calls` reach the template with `arguments` as an
  object (the OpenAI wire carries a JSON string; Qwen's templates write the object). A rendered text longer than
  `prompt_chars` allows is refused before it is tokenized.
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
    """Messages the server cannot render (a 400); `param`: the field at fault (None: the messages)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


UNICODE_MERGE = 4  # NFC / NFKC compose at most 4 code points into one (U+1F85 is alpha and three marks)
_KEEPS_CHARACTERS = {"NFD", "NFKD", "Lowercase", "Prepend", "ByteLevel", "Metaspace", "Digits", "Punctuation",
                     "UnicodeScripts", "Split"}  # normalizers / pre-tokenizers that drop no character


def _shrinks(part) -> float | None:
    """How many characters of text at most one character of `part`'s output stands for (1: it drops nothing);
    None: it may drop characters (collapse spaces, strip, remove), so no bound holds."""
    if part is None:
        return 1
    kind = part.get("type")
    if kind == "Sequence":
        factor = 1
        for sub in part.get("normalizers", part.get("pretokenizers", [])):
            f = _shrinks(sub)
            if f is None:
                return None
            factor *= f
        return factor
    if kind in ("NFC", "NFKC"):
        return UNICODE_MERGE
    if kind == "Replace":
        pattern = part.get("pattern", {})
        return 1 if "String" in pattern and len(part.get("content", "")) >= len(pattern["String"]) else None
    if kind == "Split" and part.get("behavior") == "Removed":
        return None
    return 1 if kind in _KEEPS_CHARACTERS else None


def prompt_chars(tokenizer, context: int) -> int | None:
    """The most characters a text of at most `context` tokens can have, so that a longer prompt is refused without
    tokenizing it (tokenizing 20 MB of text holds the CPU for a minute and leaves gigabytes allocated); None when
    the tokenizer allows no such bound.

    Each token stands for at most L characters of the text the tokenizer's model reads, L its longest token string
    (a byte-level token's string has a character per byte, at least as many as the characters they decode to; a
    sentencepiece piece is its characters, a byte-fallback piece `<0x0A>` six for one byte; an added token, its
    content): more than context * L characters of them make more than `context` tokens. Before the model, a
    normalizer may shrink the text: NFC / NFKC merge at most `UNICODE_MERGE` code points into one (the bound is
    multiplied by it), others drop nothing; a tokenizer that may drop characters (collapsing spaces, a BERT-like
    whitespace split) or map a whole unknown word to one token (WordPiece, an unknown token without byte fallback)
    gets no bound."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    config = json.loads(backend.to_str())
    model = config.get("model", {})
    byte_level = "ByteLevel" in json.dumps(config.get("pre_tokenizer"))
    whole_words = model.get("type") not in ("BPE", "Unigram") or (
        not byte_level and not model.get("byte_fallback") and model.get("unk_token", model.get("unk_id")) is not None)
    normalizer, pre = _shrinks(config.get("normalizer")), _shrinks(config.get("pre_tokenizer"))
    if whole_words or normalizer is None or pre is None:
        return None
    vocab = backend.get_vocab(with_added_tokens=True)
    longest = max((len(token) for token in vocab), default=1)
    return int(context * longest * normalizer * pre)


def _text(content, where: str) -> str | None:
    """A message's content as text: a string, or the text parts of a list of parts (other parts are refused)."""
    if content is None or isinstance(content, str):
        return content
    parts = []
    for k, part in enumerate(content):
        if part.get("type") != "text":
            raise ChatError(f"content parts of type {part.get('type')!r} are not supported (text only)",
                            f"{where}.[{k}].type")
        if not isinstance(part.get("text", ""), str):
            raise ChatError("a text part's text must be a string", f"{where}.[{k}].text")
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
    for i, m in enumerate(messages):
        content = _text(m.content, f"messages.[{i}].content")
        d = {"role": "system" if m.role == "developer" else m.role, "content": content}
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


def render(tokenizer, messages: list, tools: list[dict] | None, template_kwargs: dict | None = None,
           max_chars: int | None = None) -> list[int]:
    """Prompt ids: the chat template over `messages` (protocol.Message) with the generation prompt (and the
    request's `chat_template_kwargs`, e.g. Qwen3's enable_thinking). `max_chars` (prompt_chars): a longer rendered
    text is refused before it is tokenized."""
    from ..data.rows import DataError

    dicts = template_messages(messages)
    if max_chars is not None:
        if getattr(tokenizer, "chat_template", None):
            try:
                text = tokenizer.apply_chat_template(dicts, add_generation_prompt=True, tokenize=False,
                                                     **({"tools": tools} if tools else {}), **(template_kwargs or {}))
            except Exception:  # the template rejects this conversation: encode_prompt says so below
                text = ""
        else:
            text = "\n".join(m["content"] or "" for m in dicts)
        if len(text) > max_chars:
            raise ChatError(f"the rendered prompt is {len(text)} characters: more than the model's context can hold "
                            f"in tokens of this tokenizer (at most {max_chars} characters)")
    try:
        return encode_prompt(tokenizer, dicts, template_kwargs, tools=tools or None, where="the messages")
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
    text keeps the stop string or stop token it ended on (as vLLM's `include_stop_str_in_output`: without it, a
    token of `stop_ids` that ends the sample, EOS or `stop_token_ids`, gives no text even when it is not a special
    token); `skip_special=False`: special tokens are decoded as text too.
    """

    WINDOW = 6  # tokens decoded before the new ones, so a token's leading space or merged bytes come out right

    def __init__(self, tokenizer, stops: list[str] = (), watch: str | None = None, whole: bool = False,
                 include_stop: bool = False, skip_special: bool = True, stop_ids: frozenset[int] = frozenset()):
        self.tokenizer, self.stops, self.watch = tokenizer, list(stops), watch
        self.stop_ids = frozenset() if include_stop else frozenset(stop_ids)
        self.cut = 0  # trailing ids whose text is not the answer's (the stop token the sample ended on)
        self.include_stop, self.skip_special = include_stop, skip_special
        self.incremental = not whole or bool(self.stops)  # False: its text is wanted at `finish` only
        self.ids: list[int] = []
        self.logprobs: list[float] = []
        self.tops: list[list | None] = []  # each token's top log-probs (processors.py), where the request asks
        self.shown: list[float] = []  # each token's log-prob as clients see it (the model's raw distribution)
        self.text = ""  # decoded so far (cut at a stop string)
        self.sent = 0  # characters of `text` given out
        self.stopped = False
        self._prefix, self._read = 0, 0  # decode window: ids[_prefix:_read] gave text already in `text`

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special, clean_up_tokenization_spaces=False)

    def push(self, token: int, logprob: float, top: list | None = None, shown: float | None = None) -> str:
        """`logprob`: under the distribution the token was drawn from (training's); `shown`: what clients see
        (None: the same)."""
        if self.stopped:  # sampled before the cancel reached the scheduler: not part of the answer
            return ""
        self.ids.append(token)
        self.logprobs.append(logprob)
        self.tops.append(top)
        self.shown.append(logprob if shown is None else shown)
        if token in self.stop_ids:  # the sample ends on it (the scheduler's stops): no text of its own
            self.cut = 1
            return ""
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
            end = len(self.ids) - self.cut
            self.text += self._decode(self.ids[self._prefix:end])[len(self._decode(self.ids[self._prefix:self._read])):]
            self._read = end
        return self._flush()

    def tail(self) -> str:
        """The text from the watched block on (after `finish`)."""
        return self.text[self.sent:]
