"""What a rollout engine takes and gives back."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SamplingParams:
    n: int = 1
    do_sample: bool = True
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 512
    ignore_eos: bool = False
    logprobs: bool = False  # also return `rollout_log_probs`: each sampled token's log-prob under the distribution
    # it was drawn from (after temperature / top-k / top-p); greedy: under the model's unscaled distribution

    @classmethod
    def of(cls, settings, *, max_new_tokens: int, ignore_eos: bool = False, logprobs: bool = False) -> "SamplingParams":
        """From config settings holding n / do_sample / temperature / top_p / top_k (rollout or its val_kwargs)."""
        return cls(n=settings.n, do_sample=settings.do_sample, temperature=settings.temperature,
                   top_p=settings.top_p, top_k=settings.top_k, max_new_tokens=max_new_tokens, ignore_eos=ignore_eos,
                   logprobs=logprobs)

    @property
    def greedy(self) -> bool:
        return not self.do_sample or self.temperature == 0


class RolloutEngine:
    """generate(batch, sampling) -> batch with `responses` (B*n, L), `response_mask`, `input_ids`, `attention_mask`
    (and `rollout_log_probs` (B*n, L) with `sampling.logprobs`).

    The input batch holds left-padded `prompts` / `prompt_mask` (B, P) and per-prompt meta; every row is repeated
    `sampling.n` times (consecutively, sharing a `uid`).
    """

    def generate(self, batch, sampling: SamplingParams):
        raise TypeError(f"{type(self).__name__} must implement generate()")
