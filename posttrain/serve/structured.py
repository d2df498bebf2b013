"""Structured output: a request's JSON schema, regex, choice list, grammar or forced tool call as a grammar of
llguidance (the `structured` extra), whose per-token masks the scheduler applies to the logits (processors.py).

The grammar library does the work (JSON schema to grammar, the lexer, the token masks); this module only says which
grammar a request asks for, as vLLM's fields name them: `response_format` (`json_object`, `json_schema`),
`guided_json` / `guided_regex` / `guided_choice` / `guided_grammar` and `structured_outputs` (`json`, `regex`,
`choice`, `grammar`, `json_object`). A forced tool call (`tool_choice: "required"` or a named function) is the
template's own call format, hermes (tools/parse.py): `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`,
each call's object constrained by its tool's parameter schema (llguidance's Lark grammars embed JSON schemas).
"""

from __future__ import annotations

import json
import threading
import weakref

from ..tools.parse import CLOSE, OPEN


class GrammarError(ValueError):
    """A constraint the grammar library cannot compile (a 400 naming `param`)."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


def _library():
    try:
        import llguidance
        import llguidance.hf  # noqa: F401
    except ImportError:
        return None
    return llguidance


def available() -> bool:
    return _library() is not None


class Grammar:
    """One request's compiled grammar: `matcher()` gives each of its samples its own parser state."""

    def __init__(self, llg_tokenizer, grammar: str):
        self.tokenizer, self.grammar = llg_tokenizer, grammar

    def matcher(self):
        return _library().LLMatcher(self.tokenizer, self.grammar)


_tokenizers: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_lock = threading.Lock()


def _llg_tokenizer(tokenizer, vocab_size: int, eos_ids):
    """llguidance's view of the tokenizer, made once per tokenizer (about a second for a 150k vocabulary): masks as
    wide as the model's logits (`vocab_size`, padded embeddings included); a finished grammar allows one of the
    model's EOS tokens (the tokenizer's own where it is one of them)."""
    eos = tokenizer.eos_token_id if tokenizer.eos_token_id in eos_ids else min(eos_ids)
    with _lock:
        known = _tokenizers.get(tokenizer)
        if known is None or known[0] != (vocab_size, eos):
            made = _library().hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=eos)
            known = _tokenizers[tokenizer] = ((vocab_size, eos), made)
        return known[1]


def _json(schema, whitespace: bool) -> str:
    return _library().LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": whitespace})


def _tool_grammar(tokenizer, tools: list[dict], name: str | None, several: bool) -> str:
    """Lark: hermes tool calls (one, or one or more when `several`), each a JSON object naming one of `tools` (only
    `name` when given) with arguments of its parameter schema, laid out as the template writes calls. The tags match
    their tokens where the tokenizer has them as one token each (llguidance matches added tokens by id, not by
    text)."""
    options = []
    for tool in tools:
        function = tool.get("function", tool)
        if name is not None and function.get("name") != name:
            continue
        parameters = function.get("parameters") or {"type": "object", "properties": {}}
        options.append({"type": "object", "properties": {"name": {"const": function["name"]}, "arguments": parameters},
                        "required": ["name", "arguments"], "additionalProperties": False})

    def tag(text: str) -> str:
        ids = tokenizer.encode(text, add_special_tokens=False)
        return f"<[{ids[0]}]>" if len(ids) == 1 else json.dumps(text)

    if not options:
        raise GrammarError(f"tool_choice: no tool named {name!r} among the request's tools", "tool_choice")
    # the layout the template writes a call in (json.dumps' separators, no other whitespace)
    layout = {"x-guidance": {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}}
    body = json.dumps({**options[0], **layout} if len(options) == 1 else {"anyOf": options, **layout})
    more = ' ("\\n" call)*' if several else ""
    return _library().LLMatcher.grammar_from_lark(
        f"start: call{more}\n"
        f'call: {tag(OPEN)} "\\n" body "\\n" {tag(CLOSE)}\n'
        f"body: %json {body}\n")


def _grammar_of(spec: dict, param: str, tokenizer, tools) -> str | None:
    """The grammar string of one constraint (keys as `structured_outputs` names them)."""
    lib = _library()
    whitespace = not spec.get("disable_any_whitespace", False)
    if spec.get("json") is not None:
        schema = spec["json"]
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as e:
                raise GrammarError(f"{param}: the JSON schema is not JSON ({e})", param) from None
        return _json(schema, whitespace)
    if spec.get("json_object"):
        return _json({"type": "object"}, whitespace)
    if spec.get("regex") is not None:
        return lib.LLMatcher.grammar_from_regex(spec["regex"])
    if spec.get("choice") is not None:
        choices = [str(c) for c in spec["choice"]]
        if not choices:
            raise GrammarError(f"{param}: the list of choices is empty", param)
        return lib.grammar_from("choice", json.dumps(choices))
    if spec.get("grammar") is not None:
        return lib.grammar_from("grammar", spec["grammar"])
    if spec.get("tool") is not None:
        name, several = spec["tool"]
        return _tool_grammar(tokenizer, tools, name, several)
    return None


def compile_grammar(spec: dict, param: str, tokenizer, vocab_size: int, eos_ids, tools=None) -> Grammar | None:
    """The request's grammar, checked (a schema or pattern llguidance refuses is a GrammarError naming `param`);
    None when `spec` asks for nothing. Needs the `structured` extra."""
    if not any(spec.get(k) not in (None, False) for k in ("json", "json_object", "regex", "choice", "grammar", "tool")):
        return None
    lib = _library()
    if lib is None:
        raise GrammarError(f"{param}: structured output needs llguidance (pip install 'posttrain[structured]')",
                           param)
    try:
        grammar = _grammar_of(spec, param, tokenizer, tools or [])
        llg = _llg_tokenizer(tokenizer, vocab_size, eos_ids)
        error = lib.LLMatcher.validate_grammar(grammar, llg)
    except GrammarError:
        raise
    except Exception as e:  # llguidance's own errors: a schema or regex it cannot compile
        raise GrammarError(f"{param}: {e}", param) from None
    if error:
        raise GrammarError(f"{param}: {error.splitlines()[0] if error.strip() else error}", param)
    return Grammar(llg, grammar)
