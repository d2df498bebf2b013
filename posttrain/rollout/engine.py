"""posttrain's decoding engine: the model's own modules, driven by a short loop built for RL sampling.

What it does differently from transformers' `generate` (each measured in docs/performance.md):
- the `n` samples of a prompt share it: the prompt is prefilled once, and its keys and values are read once per
  step for all `n` samples (prefix_attention.py);
- prompts are prefilled in buckets of similar length, not all padded to the longest (`prefill_buckets`);
- generated keys and values go into preallocated buffers (no concatenation of the whole cache per token);
- finished rows are dropped from the batch once a quarter of it has finished;
- sampling is one inverse-CDF draw per row over filtered logits (sampling.py); decoding runs on weights already in the
  compute dtype (weights.py);
- on a GPU each decoding step is replayed as a CUDA graph (cuda_graphs.py; `rollout.enforce_eager=True` turns that
  off); finished rows are then dropped once half the batch has finished, since each compaction records a new graph.

Any model runs: the first call checks, on a few tokens, that this loop gives the logits of the model's own
forward; a model it does not match (an attention variant the shared-prefix step does not implement) is decoded
by transformers' `generate` instead, with one note.
"""

from __future__ import annotations

import functools
import inspect
import logging

import torch

from ..models.load import autocast, eval_mode
from ..models.logprobs import _unwrap
from ..models.moe import router_off
from ..parallel import agreed, is_sharded
from .base import SamplingParams
from .cuda_graphs import DecodeStep
from .hf import HFRollout
from ..models.vision import is_vision_config
from ..models.shared_prompt import attention_implementation, leading_padding
from .prefix_attention import ATTENTION_NAME, SharedPrefixCache
from .sampling import next_tokens, sampled_logprobs

log = logging.getLogger(__name__)

DROP_FINISHED_SHARE = 0.25  # drop finished rows once they are this share of the batch
STATIC_DROP_FINISHED_SHARE = 0.5  # the same with CUDA graphs (a compacted batch is recorded anew)
MAX_PREFILL_BUCKETS = 4  # prompts sorted by length are prefilled in up to this many calls ...
PREFILL_CALL_COST = 256  # ... each call counted as this many positions (its dispatch cost on small models)


def _forward(model):
    """The LM's forward, through the policy wrapper when there is one (a sharded root must see the call), taking the
    decoding cache as `cache=` (`_cache_keyword`); a MoE model collects no router logits while decoding."""
    forward = model.lm_forward if hasattr(model, "lm_forward") else model
    keyword = _cache_keyword(type(_unwrap(model.lm if hasattr(model, "lm_forward") else model)))
    quiet = router_off(model.config)

    def call(*, cache=None, **inputs):
        return forward(**inputs, **({} if cache is None else {keyword: cache}), **quiet)
    return call


@functools.cache
def _cache_keyword(lm_class) -> str:
    """transformers 5.24 renamed the forward's `past_key_values` to `cache` (the old name warns; it goes in 5.40)."""
    return "cache" if "cache" in inspect.signature(lm_class.forward).parameters else "past_key_values"


def prefill_buckets(lengths: torch.Tensor) -> list[torch.Tensor]:
    """Prompt indices sorted by length, split into 1 to `MAX_PREFILL_BUCKETS` buckets of equal count: the split with
    the fewest padded positions, each call counted as `PREFILL_CALL_COST` more (16 GSM8K prompts: 2 buckets)."""
    order = torch.argsort(lengths, stable=True)
    best_cost, best = None, [torch.arange(len(lengths))]  # one bucket: the prompts in their own order
    for count in range(1, min(MAX_PREFILL_BUCKETS, len(order)) + 1):
        parts = order.tensor_split(count)
        cost = sum(len(p) * int(lengths[p].max()) for p in parts) + PREFILL_CALL_COST * count
        if best_cost is None or cost < best_cost:
            best_cost, best = cost, (parts if count > 1 else best)
    return best


def _prefill_call(model, ids: torch.Tensor, mask: torch.Tensor):
    """One prefill forward: the last position's logits (rows, V) and the transformers cache it filled."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    out = _forward(model)(input_ids=ids, attention_mask=mask, position_ids=positions, cache=cache, use_cache=True,
                          logits_to_keep=1)
    return out.logits[:, -1], cache


class DecodeEngine(HFRollout):
    """generate(batch, sampling) as `RolloutEngine` says; see the module docstring."""

    def __init__(self, model, tokenizer, *, device, dtype, micro_batch_size: int | None = None,
                 cuda_graphs: bool = True):
        super().__init__(model, tokenizer, device=device, dtype=dtype, micro_batch_size=micro_batch_size)
        self.shared_prefix_ok: bool | None = None  # decided by the first call's check
        # CUDA graphs: on a GPU unless turned off; not for a sharded model (its forward gathers weights) nor a MoE
        # model (its expert loop asks the CPU which experts were hit: `nonzero`, which a graph cannot record).
        # `static` runs the same static-buffer loop without recording (how the tests drive that loop on a CPU).
        self.cuda_graphs = (cuda_graphs and torch.device(device).type == "cuda" and not is_sharded(model)
                            and not router_off(model.config))
        self.static = self.cuda_graphs
        self.graphs_recorded = 0  # CUDA graphs recorded by the last call

    def _generate(self, model, prompts: torch.Tensor, prompt_mask: torch.Tensor, s: SamplingParams, *,
                  images: list | None = None):
        if self.shared_prefix_ok is None:
            self.shared_prefix_ok = self._check(model)
        if not self.shared_prefix_ok:
            return super()._generate(model, prompts, prompt_mask, s, images=images)
        # the sampling noise comes from torch's global generator (the trainer seeds it per step and rank)
        generator = None if s.greedy else torch.Generator(self.device).manual_seed(int(torch.randint(0, 2**62, (1,))))
        with eval_mode(model), torch.no_grad(), autocast(self.device, self.dtype):
            tokens, logprobs = self._decode(model, prompts[:: s.n], prompt_mask[:: s.n], s, generator)
        return tokens.cpu(), (logprobs.cpu() if logprobs is not None else None)

    def _prefill(self, model, prompts: torch.Tensor, mask: torch.Tensor, n: int, max_new: int, static: bool):
        """Last-position logits (prompts, V), and the decoding cache holding the prompts' keys and values.

        Prompts are prefilled in buckets of similar length (`prefill_buckets`), each as wide as its longest prompt:
        padding to the batch's longest prompt is ~40% of a GSM8K batch's positions. The cache keeps the batch's
        width (zeros on padding, which the prefix bias masks)."""
        buckets = prefill_buckets(mask.sum(-1))
        if len(buckets) == 1:  # the call's own cache is the prefix (no copy)
            logits, cache = _prefill_call(model, prompts, mask)
            return logits, SharedPrefixCache([layer.keys for layer in cache.layers],
                                             [layer.values for layer in cache.layers], mask, n, max_new, static=static)
        width = prompts.shape[1]
        logits, keys, values = None, [], []
        for rows in buckets:
            start = leading_padding(mask[rows])
            part_logits, cache = _prefill_call(model, prompts[rows, start:], mask[rows, start:])
            if logits is None:
                logits = part_logits.new_empty(len(prompts), part_logits.shape[-1])
                for layer in cache.layers:
                    keys.append(layer.keys.new_zeros(len(prompts), layer.keys.shape[1], width, layer.keys.shape[3]))
                    values.append(layer.values.new_zeros(len(prompts), layer.values.shape[1], width,
                                                         layer.values.shape[3]))
            logits[rows] = part_logits
            for layer, k, v in zip(cache.layers, keys, values):
                k[rows, :, start:] = layer.keys
                v[rows, :, start:] = layer.values
        return logits, SharedPrefixCache(keys, values, mask, n, max_new, static=static)

    def _decode(self, model, prompts: torch.Tensor, mask: torch.Tensor, s: SamplingParams,
                generator: torch.Generator | None = None, forced: torch.Tensor | None = None,
                on_logits=None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(prompts * n, max_new) tokens, and their sampling log-probs when `s.logprobs` (else None). `forced`
        (rows, steps) replaces the sampled tokens and `on_logits(t, logits)` sees each step's logits: the check in
        `_check` uses both."""
        device, static = self.device, self.static
        step = DecodeStep(_forward(model), graphs=self.cuda_graphs) if static else None
        drop_share = STATIC_DROP_FINISHED_SHARE if static else DROP_FINISHED_SHARE
        prompts, mask = prompts.to(device), mask.to(device)
        start = leading_padding(mask)  # columns that are padding in every prompt are not computed
        prompts, mask = prompts[:, start:], mask[:, start:]
        n, steps = s.n, s.max_new_tokens
        logits, cache = self._prefill(model, prompts, mask, n, steps, static)
        logits = logits.repeat_interleave(n, dim=0)
        rows = len(prompts) * n
        position = mask.sum(dim=-1).repeat_interleave(n)  # of the next token, per row
        tokens = torch.full((rows, steps), self.pad_id, dtype=torch.long, device=device)
        logprobs = torch.zeros((rows, steps), dtype=torch.float32, device=device) if s.logprobs else None
        live = torch.arange(rows, device=device)  # the original row of each current row
        finished = torch.zeros(rows, dtype=torch.bool, device=device)
        eos = torch.tensor(sorted(self.eos_ids), device=device)
        with attention_implementation(model.config, ATTENTION_NAME):
            for t in range(steps):
                if on_logits is not None:
                    on_logits(t, logits)
                token = next_tokens(logits, s, generator) if forced is None else forced[live, t]
                tokens[live, t] = token
                if logprobs is not None:
                    logprobs[live, t] = sampled_logprobs(logits, token, s)
                if t == steps - 1:
                    break
                if not s.ignore_eos:
                    finished |= torch.isin(token, eos)
                    done = int(finished.sum())
                    if done == len(live):
                        break
                    if done >= drop_share * len(live):
                        keep = (~finished).nonzero().squeeze(1)
                        live, token, position, finished = live[keep], token[keep], position[keep], finished[keep]
                        cache.keep(keep)
                if step is not None:
                    logits = step(token, position, cache)
                else:
                    logits = _forward(model)(input_ids=token[:, None], position_ids=position[:, None], cache=cache,
                                             use_cache=True, shared_prefix=cache).logits[:, -1]
                cache.advance()
                position = position + 1
        if step is not None:
            self.graphs_recorded = step.recorded
        return tokens, logprobs

    def _check(self, model) -> bool:
        """Does the shared-prefix loop give the model's own logits? Two prompts (one left-padded) x two samples,
        three forced tokens, compared with one ordinary forward over the whole sequences."""
        config = model.config.get_text_config()
        device, vocab = self.device, config.vocab_size
        if is_vision_config(model.config):
            log.warning("posttrain decoding engine: %s is a vision-language model (its image inputs and 3-D "
                        "positions are not driven by this loop); generating with transformers' generate",
                        type(model).__name__)
            return False
        kinds = set(getattr(config, "layer_types", None) or ["full_attention"])
        if kinds != {"full_attention"}:
            log.warning("posttrain decoding engine: %s has %s layers; generating with transformers' generate",
                        type(model).__name__, ", ".join(sorted(kinds)))
            return False
        reason = self._compare(model)
        if reason is not None and self.cuda_graphs:
            graph_reason, self.cuda_graphs, self.static = reason, False, False
            reason = self._compare(model)
            if reason is None:
                log.warning("posttrain decoding engine: %s does not run as a CUDA graph (%s); decoding eagerly",
                            type(model).__name__, graph_reason)
        if not agreed(reason is None, model) and reason is None:  # a sharded model's ranks all take one path
            reason = "the check failed in another process"
        if reason is None:
            return True
        log.warning("posttrain decoding engine: %s does not run with shared-prompt decoding (%s); generating with "
                    "transformers' generate instead", type(model).__name__, reason)
        return False

    def _compare(self, model) -> str | None:
        """None when the loop's logits equal the model's own forward; else why not."""
        config = model.config.get_text_config()
        device, vocab = self.device, config.vocab_size
        gen = torch.Generator().manual_seed(0)
        prompts = torch.randint(0, min(vocab, 1000), (2, 5), generator=gen)
        mask = torch.ones_like(prompts)
        mask[1, :2] = 0
        forced = torch.randint(0, min(vocab, 1000), (4, 3), generator=gen).to(device)
        seen = []
        try:
            with eval_mode(model), torch.no_grad(), autocast(device, self.dtype):
                self._decode(model, prompts, mask, SamplingParams(n=2, max_new_tokens=3, ignore_eos=True),
                             forced=forced, on_logits=lambda t, logits: seen.append(logits.float().clone()))
                full_ids = torch.cat([prompts.to(device).repeat_interleave(2, 0), forced], dim=1)
                full_mask = torch.cat([mask.to(device).repeat_interleave(2, 0), torch.ones_like(forced)], dim=1)
                positions = (full_mask.cumsum(-1) - 1).clamp(min=0)
                ref = _forward(model)(input_ids=full_ids, attention_mask=full_mask, position_ids=positions).logits
            ref = ref[:, prompts.shape[1] - 1:-1].float()
            got = torch.stack(seen, dim=1)
            error = float((got - ref).abs().max() / ref.abs().max().clamp(min=1e-6))
            tolerance = 1e-4 if self.dtype == torch.float32 else 3e-2
            if error <= tolerance:
                return None
            return f"its logits differ from the model's own forward by {error:.1e} (relative)"
        except Exception as exc:  # an architecture whose modules the loop cannot drive
            return f"{type(exc).__name__}: {exc}"
