"""What a request's prompts pass before they are submitted: whether the request could ever be admitted (a 400
naming the limit, where a 429 would have the client retry in vain), and its prompts as token ids, made off the event
loop (a long prompt's chat template and tokenizer do not hold up the other requests) and refused, when longer than
the context could hold, before they are tokenized (chat.prompt_chars says why that is safe)."""

from __future__ import annotations

import asyncio

from .chat import ChatError, prompt_chars, render
from .errors import bad


class Admission:
    def __init__(self, tokenizer, scheduler):
        self.tokenizer, self.scheduler = tokenizer, scheduler
        self.max_chars = prompt_chars(tokenizer, scheduler.context_length)  # a longer text is refused untokenized

    def check_fits(self, prompts: int, n: int) -> None:
        """More prompts than may wait, or more samples than may run, can never be admitted."""
        most_waiting = getattr(self.scheduler, "max_waiting", None)
        most_running = getattr(self.scheduler, "max_running", None)
        if most_waiting is not None and prompts > most_waiting:
            raise bad(f"{prompts} prompts in one request can never fit: at most {most_waiting} may wait (the "
                      f"server's max_waiting); send them in smaller requests", "prompt")
        if most_running is not None and n > most_running:
            raise bad(f"n={n} can never fit: at most {most_running} samples decode at once (the server's "
                      f"max_running)", "n")

    async def chat_prompt(self, messages: list, tools: list[dict] | None, template_kwargs: dict | None) -> list[int]:
        try:
            return await asyncio.to_thread(render, self.tokenizer, messages, tools, template_kwargs, self.max_chars)
        except ChatError as e:
            raise bad(str(e), e.param or "messages") from None

    async def completion_prompts(self, given: list) -> list[list[int]]:
        return await asyncio.to_thread(self._completion_prompts, given)

    def _completion_prompts(self, given: list) -> list[list[int]]:
        """Each prompt's ids: a string tokenized (with the tokenizer's special tokens) unless it is longer than the
        context could hold; token ids checked against the context and the vocabulary."""
        tokenizer, context, out = self.tokenizer, self.scheduler.context_length, []
        for p in given:
            if isinstance(p, str) and self.max_chars is not None and len(p) > self.max_chars:
                raise bad(f"a prompt of {len(p)} characters: more than the model's context can hold in tokens of "
                          f"this tokenizer (at most {self.max_chars} characters)", "prompt")
            ids = tokenizer(p, add_special_tokens=True)["input_ids"] if isinstance(p, str) else list(p)
            if not ids:
                raise bad("the prompt is empty", "prompt")
            if len(ids) >= context:
                raise bad(f"the prompt is {len(ids)} tokens, and the model's context is {context}", "prompt")
            if min(ids) < 0 or max(ids) >= len(tokenizer):
                raise bad(f"prompt token ids must lie in [0, {len(tokenizer)})", "prompt")
            out.append(ids)
        return out
