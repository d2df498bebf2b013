"""The engine that wraps transformers' `model.generate` (`rollout.name=hf`): batched, KV-cached, sampling params as
configured. The plain reference path, and what posttrain's engine (`engine.py`) falls back to for a model its own
loop cannot run."""

from __future__ import annotations

import torch

from ..models.load import autocast, eval_mode
from ..models.logprobs import _unwrap
from ..models.moe import router_off
from ..models.vision import forward_inputs, is_vision_config, vision_token_ids
from .base import RolloutEngine, SamplingParams


class TransformersGenerate(RolloutEngine):
    """`RolloutEngine` whose chunks are decoded by transformers' `generate`."""

    def _generate(self, model, prompts: torch.Tensor, prompt_mask: torch.Tensor, s: SamplingParams, *,
                  images: list | None = None):
        return generate_with_transformers(model, prompts, prompt_mask, s, device=self.device, dtype=self.dtype,
                                          eos_ids=self.eos_ids, pad_id=self.pad_id, images=images)


def generate_with_transformers(model, prompts: torch.Tensor, prompt_mask: torch.Tensor, s: SamplingParams, *, device,
                               dtype, eos_ids: set[int], pad_id: int, images: list | None = None):
    """(rows, max_new) tokens for `rows` prompts (each repeated `n` times, consecutively), and their (rows,
    max_new) sampling log-probs when `s.logprobs` (else None). A vision-language model takes each row's image
    inputs (`images`) and never samples its vision tokens (vision.py)."""
    config = model.config.get_text_config()  # a VL model keeps use_cache on its text config
    use_cache = config.use_cache
    config.use_cache = True
    # synced_gpus=False: a sharded policy is gathered before generate, so ranks decode independently
    kwargs = dict(max_new_tokens=s.max_new_tokens, pad_token_id=pad_id, use_cache=True, synced_gpus=False,
                  eos_token_id=None if s.ignore_eos else sorted(eos_ids), **router_off(model.config))
    if is_vision_config(model.config):
        kwargs["suppress_tokens"] = vision_token_ids(model.config)
        vision = forward_inputs(_unwrap(model.lm if hasattr(model, "lm") else model), model.config,
                                prompts.to(device), prompt_mask.to(device), images)
        kwargs.update({k: v for k, v in vision.items() if k != "position_ids"})
    if s.logprobs:  # generate's scores are the logits after its processors and warpers: what it drew from
        kwargs.update(output_scores=True, return_dict_in_generate=True)
    if s.greedy:
        kwargs.update(do_sample=False, temperature=None, top_p=None, top_k=None)
    else:
        kwargs.update(do_sample=True, temperature=s.temperature, top_p=s.top_p, top_k=s.top_k if s.top_k > 0 else 0)
    try:
        with eval_mode(model), autocast(device, dtype):
            seqs = model.generate(input_ids=prompts.to(device), attention_mask=prompt_mask.to(device), **kwargs)
    finally:
        config.use_cache = use_cache
    if not s.logprobs:
        return seqs[:, prompts.shape[1]:].cpu(), None
    tokens = seqs.sequences[:, prompts.shape[1]:]
    scores = torch.stack(seqs.scores, dim=1).float()  # (rows, steps, V)
    logprobs = torch.log_softmax(scores, dim=-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    return tokens.cpu(), logprobs.nan_to_num(0.0).cpu()
