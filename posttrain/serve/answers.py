"""Pieces of the answers' layout that depend on request fields: log-prob entries (chat: `top_logprobs` per token;
text completions: `logprobs` top ones, and `echo`'s prompt before the text), and the tool calls of a turn
(`parallel_tool_calls: false`: the first call only).

A log-prob of a token the processing removed is -inf, which JSON cannot carry: it is reported as -9999.0, as vLLM
does.
"""

from __future__ import annotations

import math

from .chat import tool_message

LOWEST = -9999.0


def finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else LOWEST


def _entry(tokenizer, token: int, logprob: float) -> dict:
    text = tokenizer.decode([token], skip_special_tokens=False)
    return {"token": text, "logprob": finite(logprob), "bytes": list(text.encode("utf-8"))}


def chat_logprobs(tokenizer, tokens) -> dict:
    """Chat's `logprobs` of (token, log-prob, top log-probs or None) triples: each token's entry and its top ones,
    most likely first (`top_logprobs` of them)."""
    return {"content": [{**_entry(tokenizer, t, lp), "top_logprobs": [_entry(tokenizer, i, v) for i, v in top or ()]}
                        for t, lp, top in tokens]}


def turn(text: str, tools_on: bool, format: str, parallel: bool | None) -> tuple[str | None, list[dict]]:
    """(content, tool_calls) of a finished turn (chat.tool_message); `parallel=False`: the first call only."""
    content, calls = tool_message(text, tools_on, format)
    return content, calls[:1] if parallel is False else calls


class CompletionText:
    """One text-completion choice as its pieces go out: `piece(text, tokens)` gives the text and `logprobs` of the
    next piece; the first piece starts with the prompt when echoing (`echo()` gives its text, ids and, with
    `logprobs`, the (log-prob, top) of each token after the first, as the scheduler scored them). `text_offset`
    counts across pieces."""

    def __init__(self, tokenizer, logprobs: int | None, echo=None):
        self.tokenizer, self.logprobs, self.echo, self.offset = tokenizer, logprobs, echo, 0

    def piece(self, text: str, tokens) -> tuple[str, dict | None]:
        tokens = list(tokens)
        if self.echo is not None:
            prompt_text, ids, scored = self.echo()
            self.echo = None
            text = prompt_text + text
            scored = scored or [(None, None)] * len(ids)
            tokens = [(t, lp, top) for t, (lp, top) in zip(ids, scored)] + tokens
        if self.logprobs is None:
            return text, None
        texts = [self.tokenizer.decode([t], skip_special_tokens=False) for t, _, _ in tokens]
        offsets = [self.offset + sum(len(x) for x in texts[:k]) for k in range(len(texts))]
        self.offset += sum(len(x) for x in texts)
        tops = []
        for (t, lp, top), token_text in zip(tokens, texts):
            if lp is None:  # the prompt's first token: nothing before it predicts it
                tops.append(None)
                continue
            entries = {self.tokenizer.decode([i], skip_special_tokens=False): finite(v) for i, v in top or ()}
            entries.setdefault(token_text, finite(lp))  # the sampled token is always there (OpenAI's rule)
            tops.append(entries if self.logprobs > 0 else None)
        return text, {"tokens": texts, "token_logprobs": [None if lp is None else finite(lp) for _, lp, _ in tokens],
                      "top_logprobs": tops if self.logprobs > 0 else None, "text_offset": offsets}
