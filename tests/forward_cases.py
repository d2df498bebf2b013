"""Micro-batches shaped like real ones (left-padded prompts, right-padded responses of uneven length, multi-turn
masks with holes), shared by the shared-prompt and padding-free forward tests."""

from __future__ import annotations

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM


def shared_case(vocab: int):
    """4 prompts (two left-padded) x 3 responses (two shorter), rows of a prompt interleaved with others."""
    g = torch.Generator().manual_seed(0)
    P, L, U, n = 10, 6, 4, 3
    pm = torch.ones(U, P, dtype=torch.long)
    pm[1, :4], pm[3, :1] = 0, 0
    prompts = torch.randint(3, vocab, (U, P), generator=g) * pm
    rm = torch.ones(U * n, L, dtype=torch.long)
    rm[1, 3:], rm[7, 1:] = 0, 0
    responses = torch.randint(3, vocab, (U * n, L), generator=g) * rm
    order = torch.randperm(U * n, generator=g)  # rows of one prompt are not next to each other
    ids = torch.cat([prompts.repeat_interleave(n, 0), responses], 1)[order]
    mask = torch.cat([pm.repeat_interleave(n, 0), rm], 1)[order]
    uids = [str(int(i) // n) for i in order]
    return ids, mask, L, uids


def packed_case(vocab: int):
    """5 rows of a long-tail length mix: prompts left-padded, responses right-padded, and a multi-turn
    `response_mask` with holes (tool tokens the forward attends to but the loss skips)."""
    g = torch.Generator().manual_seed(1)
    P, L = 9, 12
    prompt_lens, response_lens = [9, 3, 6, 1, 5], [12, 2, 7, 12, 1]
    ids = torch.randint(3, vocab, (5, P + L), generator=g)
    mask = torch.zeros(5, P + L, dtype=torch.long)
    for row, (p, r) in enumerate(zip(prompt_lens, response_lens)):
        mask[row, P - p:P + r] = 1
    ids = ids * mask
    response_mask = mask[:, P:].clone()
    response_mask[0, 3:6] = 0  # tool results inside the response
    response_mask[3, 1:4] = 0
    return ids, mask, L, response_mask


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


def sliding_window_model():
    """A tiny sliding-window model: the fast paths' checks keep it on the plain path."""
    return Qwen2ForCausalLM(Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=2, num_key_value_heads=1, use_sliding_window=True,
                                        sliding_window=4, max_window_layers=0))
