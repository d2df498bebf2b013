"""The chat template's tokens for messages appended to a conversation, without re-tokenizing the conversation.

The policy's own tokens are kept as sampled; what follows them is computed from the template alone:

- the *glue* after an assistant turn's end-of-turn token (Qwen's ChatML writes `<|im_end|>` then a newline; the
  policy samples `<|im_end|>` and stops, so the newline is appended);
- the *delta* of new messages: the template applied to a fixed stand-in conversation that ends with an assistant
  turn, with and without the new messages (and the next generation prompt); the tokens after the shorter rendering
  are the new messages' tokens, whatever came before them in the real conversation.

`full_render` re-renders a whole conversation, for `tokenization_sanity_check_mode` only.
"""

from __future__ import annotations

import functools
import json

from ..data.dataset import encode_prompt

_STAND_IN = [{"role": "user", "content": "Hi."}, {"role": "assistant", "content": "Hello."}]


class TemplateError(ValueError):
    """The chat template cannot render the appended messages as a continuation of the conversation."""


def render(tokenizer, messages: list[dict], tools: list[dict] | None, *, add_generation_prompt: bool) -> list[int]:
    """Token ids of the chat template over `messages` (`tools=` offered when given)."""
    kwargs = {"tools": tools} if tools else {}
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True,
                                        **kwargs)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def encode_start(tokenizer, messages: list[dict], tools: list[dict] | None) -> list[int]:
    """The prompt of an episode: its first messages and the generation prompt."""
    return encode_prompt(tokenizer, messages, {"tools": tools} if tools else None, where="an episode's first messages")


class Template:
    """The appended tokens of one tokenizer's chat template. `eos_ids`: the tokens that end a policy turn."""

    def __init__(self, tokenizer, eos_ids: set[int]):
        self.tokenizer, self.eos_ids = tokenizer, set(eos_ids)
        self.glue = self._glue()

    def _glue(self) -> list[int]:
        """The template's tokens after an assistant turn's end-of-turn token ([] when it writes none, or when it
        ends turns with no token the policy stops on)."""
        prompt = render(self.tokenizer, _STAND_IN[:1], None, add_generation_prompt=True)
        whole = render(self.tokenizer, _STAND_IN, None, add_generation_prompt=False)
        turn = whole[len(prompt):] if whole[:len(prompt)] == prompt else whole
        ends = [i for i, t in enumerate(turn) if t in self.eos_ids]
        return turn[ends[0] + 1:] if ends else []

    def appended(self, messages: list[dict], *, ended_turn: bool = True) -> list[int]:
        """Tokens to append after an assistant turn for `messages` (tool results, user or environment turns),
        ending with the generation prompt of the next assistant turn. `ended_turn`: the policy's turn ended with an
        end-of-turn token (else the glue is left out: the template's glue follows that token)."""
        return (self.glue if ended_turn else []) + list(self._delta(json.dumps(messages, sort_keys=True)))

    @functools.lru_cache(maxsize=4096)
    def _delta(self, messages: str) -> tuple[int, ...]:
        new = json.loads(messages)
        base = render(self.tokenizer, _STAND_IN, None, add_generation_prompt=False)
        full = render(self.tokenizer, _STAND_IN + new, None, add_generation_prompt=True)
        if full[:len(base)] != base:
            raise TemplateError("the chat template renders a conversation differently once messages follow its "
                                "last assistant turn, so appended messages have no tokens of their own; use a "
                                "template that renders each message independently of the ones after it")
        return tuple(full[len(base):])


def full_render(tokenizer, messages: list[dict], tools: list[dict] | None) -> list[int]:
    """The whole conversation rendered at once (for the tokenization sanity check)."""
    return render(tokenizer, messages, tools, add_generation_prompt=False)
