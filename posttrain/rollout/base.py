"""What a rollout engine takes and gives back, and the batching every engine shares."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..data.batch import Batch, response_attention
from ..models.load import attention_backends
from ..models.vision import MM_KEY
from .weights import inference_weights


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


def response_mask_from(responses: torch.Tensor, eos_ids: set[int], pad_id: int, ignore_eos: bool) -> torch.Tensor:
    """1 up to and including the first EOS token, 0 after (B, L)."""
    if ignore_eos:
        return torch.ones_like(responses)
    is_eos = torch.zeros_like(responses, dtype=torch.bool)
    for e in eos_ids:
        is_eos |= responses == e
    # tokens strictly after the first eos are padding
    after = (torch.cumsum(is_eos.long(), dim=1) - is_eos.long()) > 0
    return (~after).long()


class RolloutEngine:
    """generate(batch, sampling) -> batch with `responses` (B*n, L), `response_mask`, `input_ids`, `attention_mask`
    (and `rollout_log_probs` (B*n, L) with `sampling.logprobs`; and `rollout_versions` (B*n, L) with a
    `between_steps` hook: the oldest weight version each token attended to).

    The input batch holds left-padded `prompts` / `prompt_mask` (B, P) and per-prompt meta; every row is repeated
    `sampling.n` times (consecutively, sharing a `uid`). An engine implements `_generate` on one chunk of rows
    (`micro_batch_size` prompts); this class splits the batch, runs each chunk through `decode` on the inference
    weights and assembles the responses and their masks. The multi-turn loop calls `decode` too.
    """

    # The engine decodes with the policy's own modules, so a sharded policy is gathered around its generate calls
    # (Actor.generation); an engine holding weights of its own (vLLM) says False.
    decodes_policy_weights = True

    def __init__(self, model, tokenizer, *, device, dtype, micro_batch_size: int | None = None):
        self.model, self.tokenizer, self.device, self.dtype = model, tokenizer, device, dtype
        self.micro_batch_size = micro_batch_size
        eos = model.generation_config.eos_token_id if model.generation_config.eos_token_id is not None else tokenizer.eos_token_id
        self.eos_ids = set(eos if isinstance(eos, (list, tuple)) else [eos])
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else next(iter(self.eos_ids))
        # Partial rollouts (asynchronous RL): `between_steps(decoding_model) -> version` may swap newer weights into
        # the decoding model; it is called before each chunk of rows and (DecodeEngine) before each decoding step,
        # and `generate` returns, per token, the oldest version among the weights it attended to (its chunk's
        # prefill) as `rollout_versions`.
        self.between_steps = None
        self.step_versions: list[int] | None = None  # the current chunk's version per decoding step

    def _weights_version(self, model) -> None:
        """Between two decoding steps of a chunk: let `between_steps` swap weights, and record the version the next
        token is sampled with (nothing outside `decode`, e.g. in the self-check)."""
        if self.between_steps is not None and self.step_versions is not None:
            self.step_versions.append(int(self.between_steps(model)))

    @torch.no_grad()
    def generate(self, batch: Batch, sampling: SamplingParams) -> Batch:
        out = batch.repeat_interleave(sampling.n)
        chunk = self.micro_batch_size * sampling.n if self.micro_batch_size else len(out)
        images = out.meta.get(MM_KEY)
        with inference_weights(self.model, self.dtype) as model, attention_backends(torch.device(self.device)):
            parts, versions = [], []  # `decode` makes the one-time decisions first
            for i in range(0, len(out), chunk):
                tokens, logprobs, steps = self.decode(model, out["prompts"][i:i + chunk],
                                                      out["prompt_mask"][i:i + chunk], sampling,
                                                      images=images[i:i + chunk] if images is not None else None)
                parts.append((tokens, logprobs))
                versions.append(steps)
        width = max(p.shape[1] for p, _ in parts)
        pad = torch.nn.functional.pad
        responses = torch.cat([pad(p, (0, width - p.shape[1]), value=self.pad_id) for p, _ in parts])
        mask = response_mask_from(responses, self.eos_ids, self.pad_id, sampling.ignore_eos)
        responses = torch.where(mask.bool(), responses, torch.full_like(responses, self.pad_id))
        out["responses"], out["response_mask"] = responses, mask
        if sampling.logprobs:
            out["rollout_log_probs"] = torch.cat([pad(lp, (0, width - lp.shape[1])) for _, lp in parts]) * mask
        if self.between_steps is not None:
            out["rollout_versions"] = torch.cat([_token_versions(v, len(p), width) for v, (p, _) in
                                                 zip(versions, parts)]) * mask.long()
        out["input_ids"] = torch.cat([out["prompts"], responses], dim=1)
        out["attention_mask"] = torch.cat([out["prompt_mask"], mask], dim=1)
        return out

    def decode(self, model, prompts: torch.Tensor, prompt_mask: torch.Tensor, s: SamplingParams, *,
               images: list | None = None) -> tuple[torch.Tensor, torch.Tensor | None, list[int] | None]:
        """One chunk of rows on the decoding weights `model`: `_generate`'s tokens and log-probs, and with a
        `between_steps` hook the versions that sampled them (else None): the prefill's, for token 0, then one per
        decoding step the engine records (the last one samples every later token)."""
        partial = self.between_steps is not None
        self.prepare(model)  # before the bracket: a self-check decodes too, and its steps are no chunk's
        self.step_versions = []
        self._weights_version(model)  # token 0 (the prefill's) and tokens until the next swap
        try:
            tokens, logprobs = self._generate(model, prompts, prompt_mask, s, images=images)
        finally:
            steps, self.step_versions = self.step_versions, None
        return tokens, logprobs, steps if partial else None

    def ready(self) -> None:
        """Make the engine's one-time decisions now, as `generate` does first. A sharded model's ranks make them
        together (a collective), so a rank with no rows to generate calls this where the others call `generate`."""
        with inference_weights(self.model, self.dtype) as model, attention_backends(torch.device(self.device)):
            self.prepare(model)

    def prepare(self, model) -> None:
        """One-time decisions on the decoding weights `model` (none here)."""

    def _generate(self, model, prompts: torch.Tensor, prompt_mask: torch.Tensor, s: SamplingParams, *,
                  images: list | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(rows, max_new) tokens for `rows` prompts (each repeated `s.n` times, consecutively), and their (rows,
        max_new) sampling log-probs when `s.logprobs` (else None)."""
        raise TypeError(f"{type(self).__name__} must implement _generate()")


def _token_versions(step_versions: list[int], rows: int, width: int) -> torch.Tensor:
    """(rows, width): the version of the chunk's prefill (step_versions[0]) on every token: the oldest weights whose
    keys and values a token attends to (its prompt's), however newer the weights a swap put in before its own step
    (those it was sampled with). Staleness counts what a token saw."""
    return torch.full((rows, width), int(step_versions[0]), dtype=torch.long)


def concat_rollouts(batches: list[Batch], pad_id: int) -> Batch:
    """Join scored rollouts of different widths: prompts re-padded on the left, responses (and every other (B, L)
    field: masks, log-probs, scores) on the right, then input_ids / attention_mask rebuilt from the two — the
    attention over every real response token (`response_attention`), which in a multi-turn batch also covers the
    appended tokens that `response_mask` leaves out."""
    if len(batches) == 1:
        return batches[0]
    P = max(b["prompts"].shape[1] for b in batches)
    L = max(b["responses"].shape[1] for b in batches)
    pad = torch.nn.functional.pad
    parts = []
    for b in batches:
        p, l = P - b["prompts"].shape[1], L - b["responses"].shape[1]
        t = {k: v for k, v in b.tensors.items() if k not in ("input_ids", "attention_mask")}  # rebuilt below
        t["prompts"] = pad(t["prompts"], (p, 0), value=pad_id)
        t["prompt_mask"] = pad(t["prompt_mask"], (p, 0))
        t["responses"] = pad(t["responses"], (0, l), value=pad_id)
        for key, value in t.items():
            if key not in ("prompts", "prompt_mask", "responses") and value.dim() == 2:
                t[key] = pad(value, (0, l))
        parts.append(Batch(t, b.meta))
    out = Batch.concat(parts)
    out["input_ids"] = torch.cat([out["prompts"], out["responses"]], dim=1)
    out["attention_mask"] = torch.cat([out["prompt_mask"], response_attention(out)], dim=1)
    return out
