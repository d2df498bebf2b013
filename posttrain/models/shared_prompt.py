"""Response log-probs with each prompt computed once for all the responses that share it.

An RL batch holds `n` responses per prompt, so a plain forward over `prompt || response` rows computes every
prompt `n` times. Here the model runs twice: over the distinct prompts (their keys and values are kept), then over
the responses alone, whose attention reads the keys and values of their row's prompt and their own, causally. The
result is the plain forward's, token for token: the same positions, the same attention arithmetic (transformers'
sdpa path: keys repeated per query head, a boolean mask), one graph for the backward pass — the prompt's weights
get the gradient of every response that read it. With `n` = 8 responses of 64 tokens to a 100-token prompt the
model processes 612 positions per prompt instead of 1,312.

Both calls run the model's own modules; only the attention function differs: `ATTENTION_NAME`, registered in
transformers' attention registry with the sdpa mask builder, which is sdpa itself for any call that does not
pass a `PromptContext`. `PolicyModel` sets it as the model's attention implementation (it stays set: a layer
recomputed in the backward pass must run as it did in the forward) once a check on a few tokens has shown that
this path gives the plain path's log-probs; a model where it does not, or that does not use sdpa, keeps the
plain path.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

ATTENTION_NAME = "posttrain_shared_prompt"


@dataclass
class PromptContext:
    """Shared between the two calls. `row_prompt` (rows,): each response row's prompt; `prompt_mask` (prompts,
    P) bool. The prompt call (`attend=False`) fills `keys` / `values` per layer; the response call (`attend=True`,
    see `responses()`) reads them. Each call gets its own object, so a layer recomputed in the backward pass
    (activation checkpointing) runs as it did in the forward."""

    row_prompt: torch.Tensor
    prompt_mask: torch.Tensor
    keys: dict = field(default_factory=dict)
    values: dict = field(default_factory=dict)
    attend: bool = False
    _mask: torch.Tensor | None = None

    def responses(self) -> "PromptContext":
        return dataclasses.replace(self, attend=True)

    def response_mask(self, length: int) -> torch.Tensor:
        """(rows, 1, length, P + length) bool: the row's prompt tokens, then its own tokens causally."""
        if self._mask is None or self._mask.shape[2] != length:
            rows, device = len(self.row_prompt), self.prompt_mask.device
            prompt = self.prompt_mask[self.row_prompt][:, None, None, :].expand(rows, 1, length, -1)
            causal = torch.ones(length, length, dtype=torch.bool, device=device).tril()
            self._mask = torch.cat([prompt, causal[None, None].expand(rows, 1, length, length)], dim=-1)
        return self._mask


def shared_prompt_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                            shared_prompt: PromptContext | None = None, sliding_window=None, softcap=None, **kwargs):
    plain = dict(dropout=dropout, scaling=scaling, sliding_window=sliding_window, softcap=softcap, **kwargs)
    if shared_prompt is None:  # any other call: sdpa, as before the model was switched to this function
        return sdpa_attention_forward(module, query, key, value, attention_mask, **plain)
    if sliding_window is not None or softcap is not None or kwargs.get("s_aux") is not None:
        raise RuntimeError("shared-prompt attention runs full attention only (no sliding window, softcap or sinks)")
    ctx, layer = shared_prompt, module.layer_idx
    if not ctx.attend:  # the prompts: ordinary attention, keys and values kept (a recompute overwrites them)
        ctx.keys[layer], ctx.values[layer] = key, value
        return sdpa_attention_forward(module, query, key, value, attention_mask, **plain)
    rows, _, length, _ = query.shape
    keys = torch.cat([ctx.keys[layer].index_select(0, ctx.row_prompt), key], dim=2)
    values = torch.cat([ctx.values[layer].index_select(0, ctx.row_prompt), value], dim=2)
    out = F.scaled_dot_product_attention(query, keys, values, attn_mask=ctx.response_mask(length), dropout_p=dropout,
                                         scale=scaling, enable_gqa=query.shape[1] != key.shape[1])
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(ATTENTION_NAME, shared_prompt_attention)
AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)


def prompt_groups(uids: list) -> tuple[torch.Tensor, torch.Tensor]:
    """(first row of each distinct prompt, each row's prompt index) from the rows' group ids."""
    first: dict = {}
    row_prompt = [first.setdefault(u, len(first)) for u in uids]
    firsts: dict = {}
    for row, u in enumerate(uids):
        firsts.setdefault(u, row)
    return torch.tensor(list(firsts.values())), torch.tensor(row_prompt)


@contextlib.contextmanager
def attention_implementation(config, name: str):
    """The model's attention modules read `config._attn_implementation` at every call: switch it for a block."""
    before = config._attn_implementation
    config._attn_implementation = name
    try:
        yield
    finally:
        config._attn_implementation = before
