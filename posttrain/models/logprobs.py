"""Log-probabilities and entropy of response tokens, computed in chunks of rows.

Why chunks: a full ``tokens x vocabulary`` float32 log-softmax is the largest tensor of an RL step (e.g. 16k
response tokens x 152k vocabulary x 4 bytes = 10 GB). We project only the hidden states that predict response
tokens, ``chunk_size`` rows at a time, and reduce each chunk to two numbers per token (log-prob, entropy) before
the next one. Under autograd, when all the logits would take more than ``KEPT_LOGITS_BYTES``, each chunk runs inside
``torch.utils.checkpoint`` so the backward pass recomputes one chunk of logits at a time instead of keeping all of
them alive; below that (a small vocabulary, few tokens) they are kept, and the backward pass does not recompute them.

Layout convention (shared by rollout, roles and trainer): ``input_ids = prompt || response`` with the prompt
left-padded to length P and the response right-padded to length L. The hidden state at position ``t`` predicts
token ``t + 1``, so the response tokens are predicted by positions ``P-1 .. P+L-2``, i.e. ``[-(L+1):-1]`` counted
from the end. Positions where the response is padding (``attention_mask == 0``) get log-prob 0 and entropy 0 and
cost no compute; callers still mask them with ``response_mask``.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from .moe import router_off
from .vision import forward_inputs, is_vision_config, vision_token_ids

__all__ = ["response_logprobs"]

Projection = Callable[[Tensor], Tensor]
SUPPRESSED_LOGIT = -1e9  # finite, so that p * z stays 0 in the entropy
# `with_entropy=SUM_PI_SQUARED` everywhere below: the second output is sum_v softmax(z)_v^2 instead of the entropy
SUM_PI_SQUARED = "sum_pi_squared"
# All of a call's logits up to this size stay alive for the backward pass instead of being recomputed chunk by chunk
# (2,048 x 8,192 tokens in float32 is 64 MiB; a 152k vocabulary exceeds it from 442 tokens on)
KEPT_LOGITS_BYTES = 256 * 2**20


class _LabelLogProb(torch.autograd.Function):
    """(log softmax(z)[label], logsumexp(z)) per row from one fused log-softmax; the backward pass writes
    softmax(z) * (g_lse - g) plus g at the label in place: two passes over the chunk where autograd's gather and
    logsumexp take about six (and as many chunk-sized temporaries)."""

    @staticmethod
    def forward(ctx, z: Tensor, labels: Tensor):
        logp_all = torch.log_softmax(z, dim=-1)
        ctx.save_for_backward(logp_all, labels)
        return logp_all.gather(-1, labels[:, None]).squeeze(-1), z[:, 0] - logp_all[:, 0]

    @staticmethod
    def backward(ctx, g_logp, g_lse):
        logp_all, labels = ctx.saved_tensors
        if g_logp is None:
            g_logp = torch.zeros_like(logp_all[:, 0])
        weight = -g_logp if g_lse is None else g_lse - g_logp
        grad = logp_all.exp().mul_(weight[:, None])
        return grad.scatter_add_(-1, labels[:, None], g_logp[:, None]), None


def _chunk_stats(
    hidden: Tensor,
    labels: Tensor,
    project: Projection,
    temperature: float,
    softcap: float | None,
    with_entropy: bool | str,
    suppressed: Tensor | None = None,
    extra: Tensor | int | None = None,
) -> tuple[Tensor, ...]:
    """Log-prob of ``labels`` and entropy for one chunk of rows; the logits live only inside this call. ``extra``:
    also the log-probs of these (N, K) token ids, or (an int k) the k most likely tokens' log-probs and ids."""
    z = project(hidden).float()
    if softcap is not None:  # Gemma-2/3 style final logit soft-capping, applied by the model before sampling
        z = torch.tanh(z / softcap) * softcap
    if temperature != 1.0:
        z = z / temperature
    if suppressed is not None:  # tokens the sampler never draws (a VL model's vision tokens): probability 0
        z = z.index_fill(-1, suppressed, SUPPRESSED_LOGIT)
    logp, lse = _LabelLogProb.apply(z, labels)
    if isinstance(extra, int):
        top = torch.topk(z, extra, dim=-1)
        extras = (top.values - lse.unsqueeze(-1), top.indices)
    else:
        extras = () if extra is None else (z.gather(-1, extra) - lse.unsqueeze(-1),)
    if not with_entropy:
        return (logp, *extras)
    p = torch.softmax(z, dim=-1)
    if with_entropy == SUM_PI_SQUARED:  # sum_v pi_v^2 instead of the entropy (optimal_token_baseline reads it)
        return logp, torch.bmm(p.unsqueeze(1), p.unsqueeze(2)).view(-1), *extras
    # H = logsumexp(z) - E_p[z]; the row-wise dot product avoids materialising p * z as another chunk-sized tensor.
    entropy = lse - torch.bmm(p.unsqueeze(1), z.unsqueeze(2)).view(-1)
    return logp, entropy, *extras


def _chunked(
    hidden: Tensor,
    labels: Tensor,
    project: Projection,
    params: list[Tensor],
    *,
    temperature: float,
    chunk_size: int,
    with_entropy: bool,
    softcap: float | None = None,
    suppressed: Tensor | None = None,
    extra: Tensor | int | None = None,
) -> tuple[Tensor, ...]:
    """Run ``_chunk_stats`` over row chunks, checkpointing each one when a gradient will flow through it and all the
    logits would outgrow ``KEPT_LOGITS_BYTES``; with ``extra`` a third output: the (N, K) log-probs of the ids
    ``extra``, or (int k) a pair of the top-k log-probs and their ids."""
    if hidden.dim() != 2 or labels.dim() != 1 or hidden.shape[0] != labels.shape[0]:
        raise ValueError(f"expected hidden (N, H) and labels (N,), got {tuple(hidden.shape)} and {tuple(labels.shape)}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    n = hidden.shape[0]
    if n == 0:
        empty = hidden.new_zeros(0, dtype=torch.float32)
        if extra is None:
            return empty, (empty.clone() if with_entropy else None)
        k = extra if isinstance(extra, int) else extra.shape[-1]
        wide = hidden.new_zeros((0, k), dtype=torch.float32)
        return empty, (empty.clone() if with_entropy else None), ((wide, wide.long()) if isinstance(extra, int)
                                                                  else wide)
    labels = labels.long()
    needs_grad = torch.is_grad_enabled() and (hidden.requires_grad or any(p.requires_grad for p in params))
    recompute = needs_grad and _logits_bytes(project, params, n) > KEPT_LOGITS_BYTES
    outs = []
    for start in range(0, n, chunk_size):
        h, y = hidden[start : start + chunk_size], labels[start : start + chunk_size]
        x = extra[start : start + chunk_size].long() if isinstance(extra, Tensor) else extra
        args = (h, y, project, temperature, softcap, with_entropy, suppressed, x)
        outs.append(checkpoint(_chunk_stats, *args, use_reentrant=False) if recompute else _chunk_stats(*args))
    cat = [o[0] if len(outs) == 1 else torch.cat(o) for o in zip(*outs)]
    logp, rest = cat[0], cat[1:]
    entropy = rest.pop(0) if with_entropy else None
    if extra is None:
        return logp, entropy
    return logp, entropy, (tuple(rest) if isinstance(extra, int) else rest[0])


def _logits_bytes(project: Projection, params: list[Tensor], rows: int) -> float:
    """What `rows` rows of float32 logits take: the vocabulary is the head weight's rows, or the head module's
    `out_features`; unknown counts as unbounded (the chunks are then recomputed)."""
    width = getattr(project, "out_features", None)
    if width is None and not isinstance(project, nn.Module) and params and params[0].dim() == 2:
        width = params[0].shape[0]
    return float("inf") if width is None else 4.0 * rows * width


def _linear_projection(weight: Tensor, bias: Tensor | None) -> Projection:
    """``h @ W^T (+ b)`` in the dtype of ``h`` (bf16 under autocast stays bf16; the cast to float32 comes after)."""

    def project(h: Tensor) -> Tensor:
        w = weight if weight.dtype == h.dtype else weight.to(h.dtype)
        b = None if bias is None or bias.dtype == h.dtype else bias.to(h.dtype)
        return F.linear(h, w, bias if b is None else b)

    return project


# ----------------------------------------------------------------------------------------------- model plumbing


def _unwrap(model: nn.Module) -> nn.Module:
    """The Hugging Face ``*ForCausalLM`` under a peft wrapper (its LoRA layers stay injected and active)."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def _decoder(base: nn.Module) -> nn.Module:
    """The backbone whose ``last_hidden_state`` is already final-normed (``model.model`` for Llama/Qwen)."""
    get_decoder = getattr(base, "get_decoder", None)
    if callable(get_decoder):
        try:
            dec = get_decoder()
            if dec is not None and dec is not base:
                return dec
        except (AttributeError, NotImplementedError, ValueError):
            pass
    for name in ("model", "transformer", "language_model", "decoder"):
        dec = getattr(base, name, None)
        if isinstance(dec, nn.Module):
            return dec
    raise TypeError(f"cannot find the decoder backbone of {type(base).__name__}")


def _head_projection(head: nn.Module) -> tuple[Projection, list[Tensor]]:
    """Projection for the output head: a plain matmul for ``nn.Linear``; otherwise call the module on each chunk.

    The module call covers heads that are not a bare weight — e.g. a LoRA-wrapped ``lm_head`` (its ``.weight``
    would silently drop the adapter delta) or custom head modules.
    """
    if isinstance(head, nn.Linear) and not hasattr(head, "base_layer"):
        return _linear_projection(head.weight, head.bias), [p for p in (head.weight, head.bias) if p is not None]
    return head, list(head.parameters())


def _softcap(config) -> float | None:
    """The final-logit soft-cap a model applies in its own forward (Gemma 2/3), or None."""
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    cap = getattr(text_config, "final_logit_softcapping", None)
    return float(cap) if cap else None


def _check_head(base: nn.Module, model_logits: Tensor, last_hidden: Tensor, project: Projection, softcap) -> None:
    """Refuse models whose forward transforms logits in a way we do not reproduce (e.g. a logit scale).

    The model's own logits for the last position came back for free; we recompute them from the same hidden state
    and require a match, so a head we do not understand fails loudly instead of giving wrong log-probs.
    """
    with torch.no_grad():
        ours = project(last_hidden).float()
        if softcap is not None:
            ours = torch.tanh(ours / softcap) * softcap
        theirs = model_logits.float()
        tol = 1e-3 + 2e-2 * theirs.abs().max().item()
        if ours.shape != theirs.shape or (ours - theirs).abs().max().item() > tol:
            raise ValueError(
                f"{type(base).__name__} transforms its logits beyond the output projection (e.g. a logit scale); "
                "posttrain.models.logprobs does not reproduce that transform"
            )


def keeps_one_logit(base: nn.Module) -> bool:
    return "logits_to_keep" in inspect.signature(base.forward).parameters


def _head(base: nn.Module) -> tuple[Projection, list[Tensor], float | None]:
    head = base.get_output_embeddings()
    if head is None:
        raise TypeError(f"{type(base).__name__} has no output embeddings (lm_head)")
    project, params = _head_projection(head)
    return project, params, _softcap(base.config)


def _final_hidden(model, base, decoder, project, softcap, router=None, router_mask=None, **inputs) -> Tensor:
    """The decoder's final-normed hidden states of one model call (`logits_to_keep=1`: one position projected,
    checked against our projection of it). A MoE model's router logits go to `router` (a moe.RouterRecorder) with
    `router_mask`, the call's real tokens; without one, the model collects none."""
    captured: list[Tensor] = []

    def grab(_module, _args, output):
        captured.append(output[0] if isinstance(output, tuple) else output.last_hidden_state)

    handle = decoder.register_forward_hook(grab)
    try:
        extra = router.forward_kwargs if router is not None else router_off(base.config)
        out = model(use_cache=False, logits_to_keep=1, **extra, **inputs)
    finally:
        handle.remove()
    if router is not None:
        router.record(out, router_mask)
    if len(captured) != 1:
        raise RuntimeError(f"expected one decoder call per forward, saw {len(captured)}")
    _check_head(base, out.logits[:, -1], captured[0][:, -1], project, softcap)
    return captured[0]


def _response_stats(rows: Tensor, labels: Tensor, valid: Tensor, project, params, softcap, *, temperature,
                    chunk_size, with_entropy, suppressed=None, extra=None) -> tuple[Tensor, ...]:
    """(B, L) log-probs / entropies from the hidden states `rows` (N, H) of the `valid` positions, in order, that
    predict `labels` there; 0 where not `valid`. With
    `extra` (ids (B, L, K), or an int k) a third output of (B, L, K) tensors, as `_chunked`'s."""
    out = _chunked(
        rows, labels[valid], project, params,
        temperature=temperature, chunk_size=chunk_size, with_entropy=with_entropy, softcap=softcap,
        suppressed=suppressed, extra=extra[valid] if isinstance(extra, Tensor) else extra,
    )
    logp_v, ent_v = out[0], out[1]
    logp = logp_v.new_zeros(labels.shape).masked_scatter(valid, logp_v)
    entropy = ent_v.new_zeros(labels.shape).masked_scatter(valid, ent_v) if with_entropy else None
    if extra is None:
        return logp, entropy

    def spread(v: Tensor) -> Tensor:  # (N, K) on the valid positions -> (B, L, K), 0 elsewhere
        full = v.new_zeros((*labels.shape, v.shape[-1]))
        full[valid] = v
        return full

    wide = out[2]
    return logp, entropy, (tuple(spread(v) for v in wide) if isinstance(wide, tuple) else spread(wide))


def response_logprobs(
    model: nn.Module,
    input_ids: Tensor,
    attention_mask: Tensor,
    response_length: int,
    *,
    temperature: float = 1.0,
    chunk_size: int = 1024,
    with_entropy: bool = True,
    prompts: tuple[Tensor, Tensor] | None = None,
    images: list | None = None,
    router=None,
    extra_tokens: Tensor | int | None = None,
    packed: bool = False,
) -> tuple[Tensor, ...]:
    """Log-probs (B, L) and entropies (B, L) of the last ``response_length`` tokens of ``input_ids`` (B, P+L).

    A vision-language model (vision.py) takes each row's image inputs in ``images`` (None for a row without), runs
    on its own 3-D positions, and its vision tokens get probability 0 (they are never sampled); ``prompts`` must be
    None then.

    ``extra_tokens``: a third output, for distillation: with ids (B, L, K) their (B, L, K) log-probs; with an int k the
    pair ((B, L, k) log-probs, (B, L, k) ids) of the k most likely tokens at each position.

    ``router`` (a ``moe.RouterRecorder``): a MoE model's router logits of every model call are recorded into it,
    each with the real tokens of the call, for the router's auxiliary loss.

    ``prompts=(prompt_rows, row_prompt)``: a row holding each distinct prompt, and each row's index into those;
    then each distinct prompt is computed once (shared_prompt.py; the model's attention implementation must be
    ``shared_prompt.ATTENTION_NAME`` and its forward take ``logits_to_keep``).

    ``packed=True``: the rows' real tokens run as one padding-free row (packed.py; the same attention
    implementation needed), with ``prompts`` each distinct prompt once; not with images.

    Positions are ``cumsum(attention_mask) - 1`` so left padding does not shift them. The model runs its normal
    forward (so wrappers' hooks — peft, FSDP — see the call) with ``logits_to_keep=1``, which keeps the vocabulary
    projection to one position; the final-normed hidden states are caught from the decoder with a forward hook and
    only the rows predicting real response tokens are projected, in chunks. Models whose forward lacks
    ``logits_to_keep`` run their decoder directly. Padded response positions return 0.
    """
    L = int(response_length)
    if input_ids.dim() != 2 or input_ids.shape != attention_mask.shape:
        raise ValueError(f"input_ids and attention_mask must be (B, T), got {tuple(input_ids.shape)}, "
                         f"{tuple(attention_mask.shape)}")
    if not 1 <= L < input_ids.shape[1]:
        raise ValueError(f"response_length must be in [1, {input_ids.shape[1] - 1}], got {L}")
    if getattr(getattr(model, "active_peft_config", None), "is_prompt_learning", False):
        raise ValueError("prompt-learning peft adapters are not supported; use LoRA")

    base = _unwrap(model)
    decoder = _decoder(base)
    position_ids = (attention_mask.long().cumsum(-1) - 1).clamp_(min=0)
    project, params, softcap = _head(base)
    suppressed, extra = None, {}
    if is_vision_config(base.config):
        if prompts is not None:
            raise ValueError("vision-language models take the plain path (prompts=None)")
        suppressed = torch.tensor(vision_token_ids(base.config), device=input_ids.device)
        extra = forward_inputs(base, base.config, input_ids, attention_mask, images)
        position_ids = extra.pop("position_ids")

    if packed:
        if suppressed is not None:
            raise ValueError("the packed path takes text rows")
        return _packed_stats(model, base, decoder, project, params, softcap, input_ids, attention_mask, L, prompts,
                             router=router, temperature=temperature, chunk_size=chunk_size, with_entropy=with_entropy,
                             extra=extra_tokens)
    if prompts is not None:
        from .shared_prompt import ATTENTION_NAME, shared_prompt_hidden

        if base.config._attn_implementation != ATTENTION_NAME:
            raise ValueError(f"shared prompts need the model's attention implementation set to {ATTENTION_NAME}")

        sharing = torch.bincount(prompts[1].to(input_ids.device), minlength=len(prompts[0]))[:, None]

        def run(**inputs):
            # Router logits count as in the plain forward: a prompt's tokens once per row that shares it (the
            # aux loss takes a weighted mask); the response call passes no mask (its attention reads the
            # prompt's), its real tokens are the responses'.
            real = (inputs["attention_mask"] * sharing if inputs["attention_mask"] is not None
                    else attention_mask[:, -L:])
            return _final_hidden(model, base, decoder, project, softcap, router=router, router_mask=real, **inputs)

        rows = shared_prompt_hidden(run, input_ids, attention_mask, L, *prompts)
    else:
        if keeps_one_logit(base):
            hidden = _final_hidden(model, base, decoder, project, softcap, router=router, router_mask=attention_mask,
                                   input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                                   **extra)
        elif router is not None:
            raise TypeError(f"{type(base).__name__}: router logits need a forward that takes logits_to_keep")
        else:
            hidden = decoder(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                             use_cache=False).last_hidden_state
        # Counted from the end: robust to anything a wrapper prepends to the sequence.
        rows = hidden[:, -(L + 1) : -1]  # (B, L, H): position t predicts token t + 1
    valid = attention_mask[:, -L:].bool()
    return _response_stats(rows[valid], input_ids[:, -L:], valid, project, params, softcap,
                           temperature=temperature, chunk_size=chunk_size, with_entropy=with_entropy,
                           suppressed=suppressed, extra=extra_tokens)


def _packed_stats(model, base, decoder, project, params, softcap, input_ids, attention_mask, L, prompts, *,
                  router, **stats) -> tuple[Tensor, ...]:
    """`response_logprobs` over the rows packed without padding (packed.py), each distinct prompt computed once
    when `prompts` groups the rows (shared_prompt.packed_shared_prompt_hidden)."""
    from .packed import mask_off, pack, predictors
    from .shared_prompt import ATTENTION_NAME, packed_shared_prompt_hidden
    from ..parallel.ulysses import active_group, on_this_share, split, sum_over_group

    if base.config._attn_implementation != ATTENTION_NAME:
        raise ValueError(f"packed rows need the model's attention implementation set to {ATTENTION_NAME}")

    def run(weights, **inputs):
        if keeps_one_logit(base):
            return _final_hidden(model, base, decoder, project, softcap, router=router, router_mask=weights, **inputs)
        if router is not None:
            raise TypeError(f"{type(base).__name__}: router logits need a forward that takes logits_to_keep")
        return decoder(use_cache=False, **inputs).last_hidden_state

    if prompts is not None:
        hidden, valid, at = packed_shared_prompt_hidden(run, input_ids, attention_mask, L, *prompts)
    else:
        rows = pack(input_ids, attention_mask)
        group = active_group()
        if group is not None:
            if router is not None:
                raise ValueError("sequence parallel: a MoE model's router loss is not supported (each rank sees "
                                 "a share of the tokens); set ulysses_sequence_parallel_size=1")
            ids, positions, packing, start = split(rows, group)
            with mask_off():
                hidden = run(None, input_ids=ids, attention_mask=None, position_ids=positions, packed=packing)[0]
            valid, at = predictors(rows, L)
            mine, at = on_this_share(valid, at, start, hidden.shape[0])
            out = _response_stats(hidden.index_select(0, at), input_ids[:, -L:], mine, project, params, softcap,
                                  **stats)
            return tuple(None if o is None else tuple(sum_over_group(v, group, hidden) for v in o)
                         if isinstance(o, tuple) else sum_over_group(o, group, hidden) for o in out)
        with mask_off():
            hidden = run(torch.ones_like(rows.input_ids), input_ids=rows.input_ids, attention_mask=None,
                         position_ids=rows.position_ids, packed=rows.packing)[0]
        valid, at = predictors(rows, L)
    return _response_stats(hidden.index_select(0, at), input_ids[:, -L:], valid, project, params, softcap, **stats)
