"""The transformers `generate` engine: batched, KV-cached, sampling params as configured. The plain reference
path (`rollout.name=hf`), and what the faster engine (`engine.py`) falls back to for a model it cannot run."""

from __future__ import annotations

import torch

from ..data.batch import Batch
from ..models.load import attention_backends, autocast, eval_mode
from ..models.logprobs import _unwrap
from ..models.moe import router_off
from ..models.vision import MM_KEY, forward_inputs, is_vision_config, vision_token_ids
from .base import RolloutEngine, SamplingParams
from .weights import inference_weights


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


class HFRollout(RolloutEngine):
    def __init__(self, model, tokenizer, *, device, dtype, micro_batch_size: int | None = None):
        self.model, self.tokenizer, self.device, self.dtype = model, tokenizer, device, dtype
        self.micro_batch_size = micro_batch_size
        eos = model.generation_config.eos_token_id if model.generation_config.eos_token_id is not None else tokenizer.eos_token_id
        self.eos_ids = set(eos if isinstance(eos, (list, tuple)) else [eos])
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else next(iter(self.eos_ids))

    @torch.no_grad()
    def generate(self, batch: Batch, sampling: SamplingParams) -> Batch:
        out = batch.repeat_interleave(sampling.n)
        chunk = self.micro_batch_size * sampling.n if self.micro_batch_size else len(out)
        images = out.meta.get(MM_KEY)
        with inference_weights(self.model, self.dtype) as model, attention_backends(torch.device(self.device)):
            parts = [self._generate(model, out["prompts"][i:i + chunk], out["prompt_mask"][i:i + chunk], sampling,
                                    images=images[i:i + chunk] if images is not None else None)
                     for i in range(0, len(out), chunk)]
        width = max(p.shape[1] for p, _ in parts)
        pad = torch.nn.functional.pad
        responses = torch.cat([pad(p, (0, width - p.shape[1]), value=self.pad_id) for p, _ in parts])
        mask = response_mask_from(responses, self.eos_ids, self.pad_id, sampling.ignore_eos)
        responses = torch.where(mask.bool(), responses, torch.full_like(responses, self.pad_id))
        out["responses"], out["response_mask"] = responses, mask
        if sampling.logprobs:
            out["rollout_log_probs"] = torch.cat([pad(lp, (0, width - lp.shape[1])) for _, lp in parts]) * mask
        out["input_ids"] = torch.cat([out["prompts"], responses], dim=1)
        out["attention_mask"] = torch.cat([out["prompt_mask"], mask], dim=1)
        return out

    def _generate(self, model, prompts: torch.Tensor, prompt_mask: torch.Tensor, s: SamplingParams, *,
                  images: list | None = None):
        """(rows, max_new) tokens for `rows` prompts (each repeated `n` times, consecutively), and their (rows,
        max_new) sampling log-probs when `s.logprobs` (else None). A vision-language model takes each row's image
        inputs (`images`) and never samples its vision tokens (vision.py)."""
        config = model.config.get_text_config()  # a VL model keeps use_cache on its text config
        use_cache = config.use_cache
        config.use_cache = True
        # synced_gpus=False: a sharded policy is gathered before generate, so ranks decode independently
        kwargs = dict(max_new_tokens=s.max_new_tokens, pad_token_id=self.pad_id, use_cache=True, synced_gpus=False,
                      eos_token_id=None if s.ignore_eos else sorted(self.eos_ids), **router_off(model.config))
        if is_vision_config(model.config):
            kwargs["suppress_tokens"] = vision_token_ids(model.config)
            vision = forward_inputs(_unwrap(model.lm if hasattr(model, "lm") else model), model.config,
                                    prompts.to(self.device), prompt_mask.to(self.device), images)
            kwargs.update({k: v for k, v in vision.items() if k != "position_ids"})
        if s.logprobs:  # generate's scores are the logits after its processors and warpers: what it drew from
            kwargs.update(output_scores=True, return_dict_in_generate=True)
        if s.greedy:
            kwargs.update(do_sample=False, temperature=None, top_p=None, top_k=None)
        else:
            kwargs.update(do_sample=True, temperature=s.temperature, top_p=s.top_p, top_k=s.top_k if s.top_k > 0 else 0)
        try:
            with eval_mode(model), autocast(self.device, self.dtype):
                seqs = model.generate(input_ids=prompts.to(self.device), attention_mask=prompt_mask.to(self.device),
                                      **kwargs)
        finally:
            config.use_cache = use_cache
        if not s.logprobs:
            return seqs[:, prompts.shape[1]:].cpu(), None
        tokens = seqs.sequences[:, prompts.shape[1]:]
        scores = torch.stack(seqs.scores, dim=1).float()  # (rows, steps, V)
        logprobs = torch.log_softmax(scores, dim=-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
        return tokens.cpu(), logprobs.nan_to_num(0.0).cpu()


def concat_rollouts(batches: list[Batch], pad_id: int) -> Batch:
    """Join scored rollouts of different widths: prompts re-padded on the left, responses (and every other (B, L)
    field) on the right, then input_ids / attention_mask rebuilt from the two."""
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
    out["attention_mask"] = torch.cat([out["prompt_mask"], out["response_mask"]], dim=1)
    return out
