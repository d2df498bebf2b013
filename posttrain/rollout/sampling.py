"""Next tokens from logits: temperature, top-k, top-p, then one exact draw per row.

The draw inverts the cumulative distribution: one uniform number per row, scaled to the row's total
probability, and the first token whose cumulative probability exceeds it (a binary search). That is exact up to
float32 rounding, as torch.multinomial is, but draws one random number per row instead of one per vocabulary
entry (the Gumbel-max trick), which on a CPU costs more than the rest of the sampling. Masked tokens (-inf, zero
probability) add nothing to the cumulative sum and are never drawn. The filters follow transformers'
warpers in order and meaning: temperature first, then top-k, then top-p keeps the smallest set of most likely
tokens whose probability reaches `top_p`.
"""

from __future__ import annotations

import torch

from .base import SamplingParams


def filtered_logits(logits: torch.Tensor, s: SamplingParams) -> torch.Tensor:
    """float32 (B, V) logits after temperature, top-k and top-p (removed tokens at -inf)."""
    x = logits.float()
    if s.temperature != 1.0:  # x / 1.0 is x: no pass over (B, V) per decoding step for RL's usual temperature
        x = x / s.temperature
    vocab = x.shape[-1]
    if 0 < s.top_k < vocab:
        kth = torch.topk(x, s.top_k, dim=-1).values[:, -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if s.top_p < 1.0:
        ordered, order = x.sort(dim=-1, descending=True)
        probs = ordered.softmax(dim=-1)
        before = probs.cumsum(dim=-1) - probs  # probability mass of the more likely tokens
        remove = torch.zeros_like(x, dtype=torch.bool).scatter_(-1, order, before >= s.top_p)
        x = x.masked_fill(remove, float("-inf"))
    return x


def next_tokens(logits: torch.Tensor, s: SamplingParams, generator: torch.Generator | None = None) -> torch.Tensor:
    """(B,) token ids: argmax when greedy, else one draw from the filtered distribution of each row."""
    if s.greedy:
        return logits.argmax(dim=-1)
    cdf = filtered_logits(logits, s).softmax(dim=-1).cumsum(dim=-1)
    u = torch.rand(cdf.shape[0], 1, generator=generator, device=cdf.device) * cdf[:, -1:]
    return torch.searchsorted(cdf, u, right=True).squeeze(1).clamp(max=cdf.shape[-1] - 1)


def sampled_logprobs(logits: torch.Tensor, tokens: torch.Tensor, s: SamplingParams) -> torch.Tensor:
    """(B,) log-prob of `tokens` under the distribution `next_tokens` drew them from (greedy: the raw logits)."""
    z = logits.float() if s.greedy else filtered_logits(logits, s)
    return torch.log_softmax(z, dim=-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
