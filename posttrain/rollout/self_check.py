"""The decoding engine's check, on its first call, that its loop gives the model's own logits.

posttrain's loop drives the model's modules with its own cache and attention (engine.py); a model whose attention
differs (a sliding window, softcapping, a vision model's 3-D positions) or whose modules the loop cannot drive
would decode wrongly. So the loop first runs on a few tokens, through the paths a real call takes — prompts of
different lengths prefilled in length buckets, rows dropped when they finish, suffix buffers grown when full —
and its logits are compared with one ordinary forward over the whole sequences. The paged state a server decodes on
(paged_state.py) is checked the same way (`check_paged`: prompt blocks shared by two rows, a shared partly filled
block copied on write, rows leaving, a block boundary crossed). A model that fails is decoded
with transformers' `generate`; with CUDA graphs on, the check is first retried without them.
"""

from __future__ import annotations

import logging

import torch

from ..models.load import autocast, eval_mode
from ..models.vision import is_vision_config
from ..parallel import agreed
from .base import SamplingParams

log = logging.getLogger(__name__)

PROMPT_LENGTHS = (7, 5, 3)  # three length buckets (one prompt each), two of them left-padded
SAMPLES = 2
STEPS = 7  # forced tokens per row ...
ENDING_ROWS = (1, 2, 4)  # ... these rows end at the second (half the rows: compacted in either mode)
FIRST_CAPACITY = 4  # suffix buffers grow mid-way (4 -> 5 -> 6 -> 7; static: 4 -> 7)


def check(engine, model) -> bool:
    """Does the shared-prefix loop give the model's own logits (`engine._compare`)? Logs why not."""
    config = model.config.get_text_config()
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
    reason = engine._compare(model)
    if reason is not None and engine.cuda_graphs:
        graph_reason, engine.cuda_graphs, engine.static = reason, False, False
        reason = engine._compare(model)
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


def _case(engine, vocab: int):
    """Left-padded prompts (3, 7), their mask, and the forced tokens (6, STEPS): random ids below 1000, none an end
    token except at the second step of `ENDING_ROWS`."""
    gen = torch.Generator().manual_seed(0)
    high = min(vocab, 1000)
    width = max(PROMPT_LENGTHS)
    prompts = torch.randint(0, high, (len(PROMPT_LENGTHS), width), generator=gen)
    mask = torch.ones_like(prompts)
    for i, length in enumerate(PROMPT_LENGTHS):
        mask[i, :width - length] = 0
    forced = torch.randint(0, high, (len(PROMPT_LENGTHS) * SAMPLES, STEPS), generator=gen)
    eos = sorted(e for e in engine.eos_ids if e is not None and 0 <= e < vocab)
    if eos:
        ordinary = next(t for t in range(high) if t not in eos)
        forced = torch.where(torch.isin(forced, torch.tensor(eos)), ordinary, forced)
        forced[list(ENDING_ROWS), 1] = eos[0]
    return prompts, mask, forced


def compare(engine, model, forward) -> str | None:
    """None when the loop's logits equal the model's own forward (`forward`, the engine's call of it); else why
    not."""
    config = model.config.get_text_config()
    device = engine.device
    prompts, mask, forced = _case(engine, config.vocab_size)
    forced = forced.to(device)
    seen = []
    try:
        with eval_mode(model), torch.no_grad(), autocast(device, engine.dtype):
            engine._decode(model, prompts, mask, SamplingParams(n=SAMPLES, max_new_tokens=STEPS), forced=forced,
                           on_logits=lambda t, ids, logits: seen.append((t, ids.clone(), logits.float().clone())),
                           call_cost=0, first_capacity=FIRST_CAPACITY)
            full_ids = torch.cat([prompts.to(device).repeat_interleave(SAMPLES, 0), forced], dim=1)
            full_mask = torch.cat([mask.to(device).repeat_interleave(SAMPLES, 0), torch.ones_like(forced)], dim=1)
            positions = (full_mask.cumsum(-1) - 1).clamp(min=0)
            ref = forward(input_ids=full_ids, attention_mask=full_mask, position_ids=positions).logits
        ref = ref[:, prompts.shape[1] - 1:-1].float()
        got = torch.cat([logits for _, _, logits in seen])
        want = torch.cat([ref[ids, t] for t, ids, _ in seen])
        error = float((got - want).abs().max() / want.abs().max().clamp(min=1e-6))
        tolerance = 1e-4 if engine.dtype == torch.float32 else 3e-2
        if error <= tolerance:
            return None
        return f"its logits differ from the model's own forward by {error:.1e} (relative)"
    except Exception as exc:  # an architecture whose modules the loop cannot drive
        return f"{type(exc).__name__}: {exc}"


def check_paged(engine, model) -> bool:
    """Does the paged state give the same logits (`compare_paged`)? Logs why not. A model that fails it is served
    on the contiguous state."""
    reason = engine._compare_paged(model)
    if not agreed(reason is None, model) and reason is None:
        reason = "the check failed in another process"
    if reason is not None:
        log.warning("posttrain decoding engine: %s does not decode on key/value blocks (%s); a server runs it on "
                    "the contiguous state", type(model).__name__, reason)
    return reason is None


def compare_paged(engine, model, forward) -> str | None:
    """`compare` for the paged state: the same prompts (the longest crossing a block boundary as it decodes, 2 rows
    sharing each prompt's blocks), forced tokens, the rows of `ENDING_ROWS` leaving after the second step."""
    from .kv_blocks import BLOCK

    config = model.config.get_text_config()
    device = engine.device
    prompts, mask, forced = _case(engine, config.vocab_size)
    extra = BLOCK - 3  # each prompt BLOCK - 3 tokens longer (its first token repeated): 20, 18 and 16 tokens,
    rows = []  # whole blocks, partly filled ones, a block boundary at the first step
    for ids, m in zip(prompts.tolist(), mask.tolist()):
        real = ids[m.index(1):]
        rows.append([real[0]] * extra + real)
    width = max(map(len, rows))
    prompts = torch.tensor([[0] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    forced = forced.to(device)
    got, want = [], []
    try:
        with eval_mode(model), torch.no_grad(), autocast(device, engine.dtype), engine.decoding(model):
            logits, state = engine.start_slots(model, prompts, mask, SAMPLES, STEPS, paged=True)
            ids = torch.arange(len(forced), device=device)
            for t in range(STEPS):
                got.append(logits.float())
                want.append((t, ids.clone()))
                if t == STEPS - 1:
                    break
                if t == 2:
                    keep = torch.tensor([j for j in range(len(ids)) if j not in ENDING_ROWS], device=device)
                    state.keep(keep)
                    ids, logits = ids[keep], logits[keep]
                logits = engine.step(model, state, forced[ids, t])
            state.release()
            full_ids = torch.cat([prompts.to(device).repeat_interleave(SAMPLES, 0), forced], dim=1)
            full_mask = torch.cat([mask.to(device).repeat_interleave(SAMPLES, 0), torch.ones_like(forced)], dim=1)
            positions = (full_mask.cumsum(-1) - 1).clamp(min=0)
            with engine._prefilling(model):
                ref = forward(input_ids=full_ids, attention_mask=full_mask, position_ids=positions).logits
        ref = ref[:, prompts.shape[1] - 1:-1].float()
        got = torch.cat(got)
        want = torch.cat([ref[ids, t] for t, ids in want])
        error = float((got - want).abs().max() / want.abs().max().clamp(min=1e-6))
        tolerance = 1e-4 if engine.dtype == torch.float32 else 3e-2
        if error <= tolerance:
            return None
        return f"its logits differ from the model's own forward by {error:.1e} (relative)"
    except Exception as exc:  # an architecture whose modules the paged step cannot drive
        return f"{type(exc).__name__}: {exc}"
