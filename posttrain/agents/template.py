"""The chat template's tokens for messages appended to a conversation, without re-tokenizing the conversation.

The policy's own tokens are kept as sampled; what follows an assistant turn is taken from the template alone, as the
template writes it in a whole conversation: everything after that turn's end-of-turn token (the *glue*, e.g. the
newline after Qwen's `<|im_end|>`), the new messages, and the next generation prompt.

How: the template renders a fixed stand-in conversation — a user turn, an assistant turn, then the new messages and
the generation prompt — and the tokens after the stand-in assistant's end-of-turn token are the appended ones. Only
the new messages' part is kept, so whatever came before them in the real conversation does not matter (verl's tool
agent loop likewise renders only the new messages and strips the template's system prefix). Starting the stand-in
with a user turn serves templates that insert a default system prompt (Qwen2.5: it stays before the cut), that
refuse a conversation not starting with a user turn or whose roles do not alternate (Gemma, Mistral), and that
render the last assistant turn differently from earlier ones (Qwen3 writes an empty `<think></think>` into the last
one only): the cut is after the stand-in turn, whichever way it is rendered. The tokens are the tokenization of the
whole rendered text, sliced at the cut, so a tokenizer that treats the start of a text specially changes nothing.

A template that cannot render the stand-in raises `TemplateError` when the runner is built; one that cannot render
some appended messages (Gemma has no `tool` role) raises it for those, and the episode loop ends that episode.

`full_render` re-renders a whole conversation, for `tokenization_sanity_check_mode` only.

A vision-language row's episode (`images`: its image inputs, as the dataset's processor made them) starts from its
messages with each `<image>` placeholder rendered as the template's image part and widened to the image's tokens,
as the processor writes them; appended messages stay text.
"""

from __future__ import annotations

import functools
import json

from ..data.dataset import encode_prompt
from ..models.vision import image_messages, widen_image_tokens

_ANSWER = "Stand-in answer 7."  # the stand-in assistant turn's content: where the appended text starts
_STAND_IN = [{"role": "user", "content": "Stand-in question."}, {"role": "assistant", "content": _ANSWER}]


class TemplateError(ValueError):
    """The chat template cannot render the appended messages as a continuation of the conversation."""


def render(tokenizer, messages: list[dict], tools: list[dict] | None, *, add_generation_prompt: bool,
           **template_kwargs) -> list[int]:
    """Token ids of the chat template over `messages` (`tools=` offered when given)."""
    kwargs = {"tools": tools} if tools else {}
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True,
                                        **kwargs, **template_kwargs)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def encode_start(tokenizer, messages: list[dict], tools: list[dict] | None, template_kwargs: dict | None = None,
                 *, images: dict | None = None, config=None) -> list[int]:
    """The prompt of an episode: its first messages and the generation prompt; with `images` (a VL row's image
    inputs; `config` the model's) its image tokens as the processor writes them."""
    where = "an episode's first messages"
    if images is None:
        return encode_prompt(tokenizer, messages, template_kwargs, where=where, tools=tools)
    parts = image_messages(messages, len(images["image_grid_thw"]), where)
    return widen_image_tokens(encode_prompt(tokenizer, parts, template_kwargs, where=where, tools=tools), config,
                              images)


class Template:
    """The appended tokens of one tokenizer's chat template. `eos_ids`: the tokens that end a policy turn;
    `template_kwargs`: the template's own arguments (`data.apply_chat_template_kwargs`, e.g. `enable_thinking`)."""

    def __init__(self, tokenizer, eos_ids: set[int], template_kwargs: dict | None = None, format: str = "hermes"):
        self.tokenizer, self.eos_ids = tokenizer, set(eos_ids)
        self.kwargs, self.format = dict(template_kwargs or {}), format
        self.ends = sorted({tokenizer.decode([t], skip_special_tokens=False) for t in self.eos_ids} - {""},
                           key=len, reverse=True)
        base = self._text(_STAND_IN, generation=False)
        self.glue = self._ids_after(base, self._cut(base))

    def appended(self, messages: list[dict]) -> list[int]:
        """Tokens to append after an assistant turn that ended with an end-of-turn token, for `messages` (tool
        results, user or environment turns): the glue, the messages, the next generation prompt."""
        if self.format == "gpt-oss":
            return self._harmony(messages)
        return list(self._appended(json.dumps(messages, sort_keys=True)))

    def _harmony(self, messages: list[dict]) -> list[int]:
        """gpt-oss (tool-call format `gpt-oss`): the messages in OpenAI's harmony format written by hand, as verl
        writes them, since the gpt-oss chat template renders a tool answer only after an assistant message with
        `tool_calls`: a tool answer `<|start|>functions.NAME to=assistant<|channel|>commentary<|message|>...<|end|>`,
        another message `<|start|>ROLE<|message|>...<|end|>`, then the generation prompt `<|start|>assistant`. (The
        policy's turn ended on `<|call|>`: nothing comes between.)"""
        parts = []
        for m in messages:
            if not isinstance(m.get("content"), str):
                raise TemplateError("appended messages of the gpt-oss format are text")
            if m.get("role") == "tool":
                parts.append(f"<|start|>functions.{m.get('name') or ''} to=assistant<|channel|>commentary"
                             f"<|message|>{m['content']}<|end|>")
            else:
                parts.append(f"<|start|>{m.get('role')}<|message|>{m['content']}<|end|>")
        return list(self.tokenizer("".join(parts) + "<|start|>assistant", add_special_tokens=False)["input_ids"])

    @functools.lru_cache(maxsize=4096)
    def _appended(self, messages: str) -> tuple[int, ...]:
        whole = self._text(_STAND_IN + json.loads(messages), generation=True)
        return tuple(self._ids_after(whole, self._cut(whole)))

    def _text(self, messages: list[dict], *, generation: bool) -> str:
        try:
            return self.tokenizer.apply_chat_template(messages, add_generation_prompt=generation, tokenize=False,
                                                      **self.kwargs)
        except Exception as e:  # jinja's errors, the template's own raise_exception
            roles = [m.get("role") for m in messages[len(_STAND_IN):]]
            what = f"messages of roles {roles} after an assistant turn" if roles else "a user turn and an answer"
            raise TemplateError(f"the chat template cannot render {what} ({type(e).__name__}: {e})") from None

    def _cut(self, text: str) -> int:
        """Where the stand-in assistant turn ends in `text`: after its end-of-turn token (whitespace between the
        content and it allowed), or right after its content when the template writes no token the policy stops
        on."""
        at = text.find(_ANSWER)
        if at < 0:
            raise TemplateError("the chat template does not write an assistant turn's content as it is; appended "
                                "messages cannot be placed after the policy's own tokens")
        at += len(_ANSWER)
        rest = text[at:].lstrip()
        for end in self.ends:
            if rest.startswith(end):
                return len(text) - len(rest) + len(end)
        return at

    def _ids_after(self, text: str, cut: int) -> list[int]:
        """The ids of `text`'s tokenization from `cut` on (a token boundary: the cut follows a special token)."""
        try:
            enc = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        except (NotImplementedError, ValueError):  # a tokenizer without offsets: the text after the cut alone
            return list(self.tokenizer(text[cut:], add_special_tokens=False)["input_ids"])
        ids, offsets = enc["input_ids"], enc["offset_mapping"]
        first = next((i for i, (_, end) in enumerate(offsets) if end > cut), len(ids))
        if first < len(ids) and offsets[first][0] < cut:
            return list(self.tokenizer(text[cut:], add_special_tokens=False)["input_ids"])
        return list(ids[first:])


def full_render(tokenizer, messages: list[dict], tools: list[dict] | None, template_kwargs: dict | None = None,
                *, images: dict | None = None, config=None) -> list[int]:
    """The whole conversation rendered at once (for the tokenization sanity check), image tokens as in
    `encode_start`."""
    if images is None:
        return render(tokenizer, messages, tools, add_generation_prompt=False, **(template_kwargs or {}))
    parts = image_messages(messages, len(images["image_grid_thw"]), "an episode's messages")
    return widen_image_tokens(render(tokenizer, parts, tools, add_generation_prompt=False, **(template_kwargs or {})),
                              config, images)
