"""What the server does with each request field: every field of the request models acts, the fields of vLLM's
requests that posttrain does not implement are refused (400 naming them) when given a value other than their
default, and fields neither API knows are ignored with a warning in the log, as vLLM does.

`screen(body)` makes those checks (a `FieldError` is the 400); `options(body, ...)` turns the fields that change
decoding into what the scheduler takes: stop ids, `ignore_eos`, the prompt's log-probs for `echo`, and the logits
processing of processors.py (penalties, biases, masks, `min_p`, a grammar of structured.py, top log-probs).
"""

from __future__ import annotations

import asyncio
import logging
import math

from .processors import Processing
from .structured import GrammarError, compile_grammar

log = logging.getLogger(__name__)


class FieldError(ValueError):
    """A request field the server refuses (400): `param` names it."""

    def __init__(self, message: str, param: str | None):
        super().__init__(message)
        self.param = param


# vLLM's request fields (its ChatCompletionRequest / CompletionRequest) that posttrain does not implement, with the
# values that mean "not asked" (null always does). Any other value is refused.
_VLLM_BOTH = {
    "use_beam_search": (False,), "length_penalty": (1.0,), "prompt_logprobs": (), "priority": (0,),
    "guided_decoding_backend": ("auto", "guidance"), "guided_whitespace_pattern": (), "logits_processors": (),
    "return_tokens_as_token_ids": (False,), "return_token_ids": (False,), "cache_salt": (), "kv_transfer_params": (),
    "ec_transfer_params": (), "vllm_xargs": (), "truncate_prompt_tokens": (), "truncation_side": (),
    "logprob_token_ids": (), "spaces_between_special_tokens": (True,), "watermarking": (False,),
    "repetition_detection": (), "stream_interval": (), "routed_experts_prompt_start": (0,),
    "return_token_offsets": (False,), "return_mm_kwargs": (True,), "thinking_token_budget": (),
}
VLLM_UNSUPPORTED = {
    "chat": {**_VLLM_BOTH, "best_of": (), "echo": (False,), "add_generation_prompt": (True,),
             "continue_final_message": (False,), "add_special_tokens": (False,), "documents": (), "chat_template": (),
             "mm_processor_kwargs": (), "media_io_kwargs": (), "structural_tag": (), "reasoning_effort": (),
             "include_reasoning": (True,), "return_prompt_text": (False,)},
    "completion": {**_VLLM_BOTH, "add_special_tokens": (True,), "prompt_embeds": ()},
}
# structured_outputs keys (vLLM's StructuredOutputsParams) this server implements
_STRUCTURED = {"json", "regex", "choice", "grammar", "json_object", "disable_any_whitespace", "disable_fallback"}


def _is(value, accepted: tuple) -> bool:
    """Whether `value` means "not asked": null, an empty list or object, or one of `accepted` (true is not 1)."""
    return value is None or (isinstance(value, (list, dict)) and not value) or any(
        value == a and isinstance(value, bool) == isinstance(a, bool) for a in accepted)


def screen(body) -> None:
    """FieldError for a refused field; a warning for fields nobody knows; the request's identity logged (`user`,
    `session_id`: who and which conversation, for the operator, which is what they are for)."""
    kind = "chat" if hasattr(body, "messages") else "completion"
    refused, unknown = [], []
    for name, value in (body.model_extra or {}).items():
        if name in VLLM_UNSUPPORTED[kind]:
            if not _is(value, VLLM_UNSUPPORTED[kind][name]):
                refused.append(name)
        else:
            unknown.append(name)
    if refused:
        raise FieldError(f"{', '.join(refused)}: not supported by this server (vLLM's field{'s' * (len(refused) > 1)}"
                         f"; send {'them' if len(refused) > 1 else 'it'} unset or at the default)", refused[0])
    if unknown:
        log.warning("the following fields were present in the request but ignored: %s", sorted(unknown))
    if body.user is not None or body.session_id is not None:
        log.info("%s request of user %r, session %r", kind, body.user, body.session_id)
    if body.stream_options is not None and not body.stream:
        raise FieldError("stream_options: only with stream=true", "stream_options")
    if body.stream_options is not None and body.stream_options.continuous_usage_stats:
        raise FieldError("stream_options.continuous_usage_stats is not supported (include_usage gives the usage "
                         "in the last chunk)", "stream_options")
    if kind == "chat":
        if body.top_logprobs and not body.logprobs:
            raise FieldError("top_logprobs: needs logprobs=true", "top_logprobs")
        choice = body.tool_choice
        if choice not in (None, "auto", "none", "required") and not (
                isinstance(choice, dict) and choice.get("type", "function") == "function"
                and isinstance(choice.get("function"), dict) and isinstance(choice["function"].get("name"), str)):
            raise FieldError('tool_choice: "none", "auto", "required" or {"type": "function", "function": {"name": '
                             '...}}', "tool_choice")
        if choice not in (None, "auto", "none") and not body.tools:
            raise FieldError("tool_choice: forcing a tool call needs tools", "tool_choice")
    else:
        if body.suffix:
            raise FieldError("suffix is not supported", "suffix")
        if body.best_of is not None and body.best_of != body.n:
            raise FieldError("best_of is not supported (other than n)", "best_of")
    max_new = body.new_tokens()
    if max_new is not None and body.min_tokens > max_new:
        raise FieldError(f"min_tokens={body.min_tokens} is more than max_tokens={max_new}", "min_tokens")


def _ids(values, vocab: int, param: str) -> tuple[int, ...]:
    out = []
    for v in values:
        try:
            t = int(v)
        except (TypeError, ValueError):
            raise FieldError(f"{param}: {v!r} is not a token id", param) from None
        if not 0 <= t < vocab:
            raise FieldError(f"{param}: token id {t} is outside the vocabulary [0, {vocab})", param)
        out.append(t)
    return tuple(out)


def _bias(logit_bias: dict, vocab: int) -> tuple[tuple[int, float], ...]:
    ids = _ids(logit_bias, vocab, "logit_bias")
    bias = [float(b) for b in logit_bias.values()]
    if any(not (math.isfinite(b) and -100 <= b <= 100) for b in bias):
        raise FieldError("logit_bias: each bias must lie in [-100, 100]", "logit_bias")
    return tuple(zip(ids, bias))


def _bad_words(words: list[str], tokenizer) -> tuple[tuple[int, ...], ...]:
    """Each word's token ids, alone and after a space (vLLM's rule: the spaced form where it starts with another
    token and is as long)."""
    out = []
    for word in words:
        plain = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        out += [tuple(plain)] if plain else []
        if spaced and (not plain or (spaced[0] != plain[0] and len(spaced) == len(plain))):
            out.append(tuple(spaced))
    return tuple(out)


def constraint(body) -> tuple[dict, str] | None:
    """The structured output asked for (one at most) and the field asking: keys as vLLM's structured_outputs."""
    asked = []
    rf = body.response_format
    if rf is not None and rf.get("type", "text") != "text":
        kind = rf.get("type")
        if kind == "json_object":
            asked.append(({"json_object": True}, "response_format"))
        elif kind == "json_schema":
            schema = (rf.get("json_schema") or {}).get("schema")
            if schema is None:
                raise FieldError('response_format: json_schema needs {"json_schema": {"name": ..., "schema": {...}}}',
                                 "response_format")
            asked.append(({"json": schema}, "response_format"))
        else:
            raise FieldError(f"response_format: type {kind!r} is not supported (text, json_object, json_schema)",
                             "response_format")
    for key in ("json", "regex", "choice", "grammar"):
        if getattr(body, f"guided_{key}") is not None:
            asked.append(({key: getattr(body, f"guided_{key}")}, f"guided_{key}"))
    so = body.structured_outputs
    if so:
        extra = sorted(k for k, v in so.items() if k not in _STRUCTURED and v not in (None, False, "", [], {}))
        if extra:
            raise FieldError(f"structured_outputs: {', '.join(extra)} not supported (json, regex, choice, grammar, "
                             f"json_object, disable_any_whitespace)", "structured_outputs")
        asked.append((dict(so), "structured_outputs"))
    choice = getattr(body, "tool_choice", None)
    if choice == "required" or isinstance(choice, dict):
        name = choice["function"]["name"] if isinstance(choice, dict) else None
        asked.append(({"tool": (name, choice == "required" and body.parallel_tool_calls is not False)},
                      "tool_choice"))
    settings = ("disable_any_whitespace", "disable_fallback")  # how, not what: they go with the constraint asked
    asked = [(spec, param) for spec, param in asked if any(v not in (None, False) for k, v in spec.items()
                                                           if k not in settings)]
    if len(asked) > 1:
        raise FieldError(f"{asked[1][1]}: only one kind of structured output per request (also {asked[0][1]})",
                         asked[1][1])
    if not asked:
        return None
    spec, param = asked[0]
    return {**{k: v for k, v in (so or {}).items() if k in settings}, **spec}, param


async def options(body, tokenizer, vocab: int, eos_ids) -> dict:
    """RequestSampling's fields for `body` beyond temperature / top-p / top-k / max_tokens / seed: stop ids,
    ignore_eos, prompt_logprobs (echo), processing (None: plain sampling). A grammar compiles off the event loop."""
    chat = hasattr(body, "messages")
    top = (body.top_logprobs or 0) if chat and body.logprobs else (body.logprobs or 0) if not chat else 0
    asked = constraint(body)
    grammar = None
    if asked is not None:
        spec, param = asked
        tools = getattr(body, "tools", None)
        try:
            grammar = await asyncio.to_thread(compile_grammar, spec, param, tokenizer, vocab, eos_ids, tools)
        except GrammarError as e:
            raise FieldError(str(e), e.param) from None
    processing = Processing(
        presence_penalty=body.presence_penalty or 0.0, frequency_penalty=body.frequency_penalty or 0.0,
        repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
        logit_bias=_bias(body.logit_bias, vocab) if body.logit_bias else (), min_tokens=body.min_tokens,
        min_p=body.min_p or 0.0,
        allowed_token_ids=_ids(body.allowed_token_ids, vocab, "allowed_token_ids") if body.allowed_token_ids else (),
        bad_words=_bad_words(body.bad_words, tokenizer) if body.bad_words else (), grammar=grammar,
        top_logprobs=top)
    if body.allowed_token_ids is not None and not body.allowed_token_ids:
        raise FieldError("allowed_token_ids: an empty list allows no token", "allowed_token_ids")
    echo = not chat and body.echo
    return dict(stop_token_ids=_ids(body.stop_token_ids or (), vocab, "stop_token_ids"), ignore_eos=body.ignore_eos,
                processing=None if processing == Processing() else processing,
                prompt_logprobs=(body.logprobs or 0) if echo and body.logprobs is not None else None)
