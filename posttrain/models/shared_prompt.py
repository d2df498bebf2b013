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

import logging

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from .load import eval_mode
from .packed import Packing, attention_after_prompt, in_packed_call, mask_off, pack, sdpa
from .packed import attention as packed_attention

ATTENTION_NAME = "posttrain_shared_prompt"
log = logging.getLogger(__name__)


class PromptKeyValues:
    """Per-layer keys and values of the prompt call, read by the response call. A plain object, not a dict: FSDP2
    rebuilds the dicts and dataclasses in a forward's arguments when it moves them to the device, and both calls
    must see the same storage."""

    def __init__(self):
        self.keys: dict = {}
        self.values: dict = {}


@dataclass
class PromptContext:
    """Shared between the two calls. `row_prompt` (rows,): each response row's prompt; `prompt_mask` (prompts,
    P) bool. The prompt call (`attend=False`) fills `stored` per layer; the response call (`attend=True`,
    see `responses()`) reads them. Each call gets its own object, so a layer recomputed in the backward pass
    (activation checkpointing) runs as it did in the forward."""

    row_prompt: torch.Tensor
    prompt_mask: torch.Tensor
    stored: PromptKeyValues = field(default_factory=PromptKeyValues)
    attend: bool = False
    _mask: torch.Tensor | None = None
    prompt_packing: Packing | None = None  # packed prompts and responses (packed_shared_prompt_hidden)
    row_prompt_list: list[int] | None = None

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
                            shared_prompt: PromptContext | None = None, sliding_window=None, softcap=None,
                            packed: Packing | None = None, **kwargs):
    plain = dict(dropout=dropout, scaling=scaling, sliding_window=sliding_window, softcap=softcap, **kwargs)
    if packed is not None:  # a padding-free call (packed.py)
        if sliding_window is not None or softcap is not None or kwargs.get("s_aux") is not None:
            raise RuntimeError("packed attention runs full attention only (no sliding window, softcap or sinks)")
        if packed.sequence_group is not None:  # this rank's share of the row (ulysses.py)
            if shared_prompt is not None:
                raise RuntimeError("a sequence-parallel call shares no prompts")
            from ..parallel.ulysses import attention as sequence_parallel_attention

            return sequence_parallel_attention(
                lambda q, k, v: packed_attention(module, q, k, v, packed, dropout=dropout, scaling=scaling),
                query, key, value, packed)
        if shared_prompt is not None and shared_prompt.attend:  # packed responses after their packed prompts
            ctx, layer = shared_prompt, module.layer_idx
            return attention_after_prompt(query, key, value, ctx.stored.keys[layer], ctx.stored.values[layer],
                                          ctx.prompt_packing, packed, ctx.row_prompt_list, dropout=dropout,
                                          scaling=scaling, grouped_heads=grouped_heads_in_sdpa(key))
        if shared_prompt is not None:  # the packed prompts: their keys and values kept for the responses
            shared_prompt.stored.keys[module.layer_idx] = key
            shared_prompt.stored.values[module.layer_idx] = value
        return packed_attention(module, query, key, value, packed, dropout=dropout, scaling=scaling)
    if shared_prompt is None:  # any other call: sdpa, as before the model was switched to this function
        return sdpa_attention_forward(module, query, key, value, attention_mask, **plain)
    if sliding_window is not None or softcap is not None or kwargs.get("s_aux") is not None:
        raise RuntimeError("shared-prompt attention runs full attention only (no sliding window, softcap or sinks)")
    ctx, layer = shared_prompt, module.layer_idx
    if not ctx.attend:  # the prompts: ordinary attention, keys and values kept (a recompute overwrites them)
        ctx.stored.keys[layer], ctx.stored.values[layer] = key, value
        return sdpa_attention_forward(module, query, key, value, attention_mask, **plain)
    length = query.shape[2]
    keys = torch.cat([ctx.stored.keys[layer].index_select(0, ctx.row_prompt), key], dim=2)
    values = torch.cat([ctx.stored.values[layer].index_select(0, ctx.row_prompt), value], dim=2)
    groups = query.shape[1] // key.shape[1]
    if groups > 1 and not grouped_heads_in_sdpa(keys):
        keys, values = repeat_kv(keys, groups), repeat_kv(values, groups)
    out = sdpa(query, keys, values, attn_mask=ctx.response_mask(length), dropout_p=dropout,
                                         scale=scaling, enable_gqa=keys.shape[1] != query.shape[1])
    return out.transpose(1, 2).contiguous(), None


def grouped_heads_in_sdpa(keys) -> bool:
    """Whether sdpa gets the grouped key/value heads (`enable_gqa`) rather than keys repeated per query head
    (benchmarks/grouped_heads.py). On a CPU, yes: forward + backward 1.3-2.1x faster than with repeated keys. On a
    GPU, a mask with grouped heads leaves sdpa only its math kernel, which stores every attention weight for the
    backward pass (H100: 1.1-2.3x the time and memory of repeated keys, which the memory-efficient kernel takes),
    and transformers' sdpa path repeats the keys of a masked call too."""
    return keys.device.type == "cpu"


# Under use_torch_compile (models/compile.py) this function runs eagerly between the compiled parts of each layer:
# the keys it keeps per layer index and its packed / sequence-parallel branches would make a graph per layer and
# mode, and sdpa is one fused kernel already.
AttentionInterface.register(ATTENTION_NAME, torch.compiler.disable(shared_prompt_attention))
def mask_unless_packed(*args, **kwargs):
    """sdpa's mask, except for a packed call, which needs none (packed.mask_off)."""
    return None if in_packed_call() else sdpa_mask(*args, **kwargs)


AttentionMaskInterface.register(ATTENTION_NAME, mask_unless_packed)


def shared_prompt_hidden(run, input_ids, attention_mask, response_length: int, prompt_rows, row_prompt):
    """(rows, L, H) final hidden states at the positions that predict each response token (the prompt's last
    position, then the responses' own), with each distinct prompt computed once. `run(input_ids=,
    attention_mask=, position_ids=, shared_prompt=)` runs the decoder and returns its (b, T, H) hidden states;
    the model's attention implementation must be `ATTENTION_NAME`."""
    L, device = int(response_length), input_ids.device
    prompt_rows, row_prompt = prompt_rows.to(device), row_prompt.to(device)
    prompts, prompt_mask = input_ids[prompt_rows, :-L], attention_mask[prompt_rows, :-L]
    start = leading_padding(prompt_mask)
    prompts, prompt_mask = prompts[:, start:], prompt_mask[:, start:]
    ctx = PromptContext(row_prompt=row_prompt, prompt_mask=prompt_mask.bool())
    prompt_hidden = run(input_ids=prompts, attention_mask=prompt_mask,
                        position_ids=(prompt_mask.long().cumsum(-1) - 1).clamp(min=0), shared_prompt=ctx)
    positions = prompt_mask.long().sum(-1)[row_prompt][:, None] + torch.arange(L, device=device)
    response_hidden = run(input_ids=input_ids[:, -L:], attention_mask=None, position_ids=positions,
                          shared_prompt=ctx.responses())
    return torch.cat([prompt_hidden[:, -1][row_prompt][:, None], response_hidden[:, :-1]], dim=1)


def packed_shared_prompt_hidden(run, input_ids, attention_mask, response_length: int, prompt_rows, row_prompt):
    """`shared_prompt_hidden` with the prompts and the responses each packed without padding (packed.py): returns
    (hidden (N, H) of both calls, valid (rows, L) the real response tokens, at: the row of `hidden` that predicts
    each of them — the prompt's last token for the first, the response's previous token for the others).
    `run(weights, **inputs)` runs the model (inputs with `packed=` and `shared_prompt=`); `weights` (1, n) counts
    the rows each token of the call stands for (a prompt's sharers): what a MoE model's router logits weigh."""
    L, device = int(response_length), input_ids.device
    prompt_rows, row_prompt = prompt_rows.to(device), row_prompt.to(device)
    prompt_mask = attention_mask[prompt_rows, :-L]
    prompts, responses = pack(input_ids[prompt_rows, :-L], prompt_mask), pack(input_ids[:, -L:], attention_mask[:, -L:])
    prompt_lens = prompt_mask.long().sum(-1)
    response_mask = attention_mask[:, -L:].long()
    positions = (prompt_lens[row_prompt][:, None] + response_mask.cumsum(-1) - 1)[response_mask.bool()][None]
    ctx = PromptContext(row_prompt=row_prompt, prompt_mask=prompt_mask.bool(), prompt_packing=prompts.packing,
                        row_prompt_list=row_prompt.tolist())
    sharing = torch.bincount(row_prompt, minlength=len(prompt_rows)).repeat_interleave(prompt_lens)[None]
    with mask_off():
        prompt_hidden = run(sharing, input_ids=prompts.input_ids, attention_mask=None,
                            position_ids=prompts.position_ids, shared_prompt=ctx, packed=prompts.packing)
        response_hidden = run(torch.ones_like(responses.input_ids), input_ids=responses.input_ids,
                              attention_mask=None, position_ids=positions, shared_prompt=ctx.responses(),
                              packed=responses.packing)
    valid = responses.index >= 0
    prompt_last = torch.tensor(prompts.packing.bounds[1:], device=device)[row_prompt] - 1
    previous = responses.index - 1 + prompt_hidden.shape[1]
    at = torch.where(torch.arange(L, device=device) == 0, prompt_last[:, None], previous)[valid]
    return torch.cat([prompt_hidden[0], response_hidden[0]]), valid, at


def each_row_its_own_prompt(module, prompts, rows: int) -> bool:
    """No prompt is shared, so the plain forward (one call) does the shared pass's work (two calls). Not for a
    sharded model: its ranks must make the same calls whatever rows each holds, or they wait on each other."""
    from ..parallel import is_sharded

    return len(prompts[0]) == rows and not is_sharded(module)


def switch_on_if_equal(module, config, plain, shared, what: str, *, packed: bool = False) -> bool:
    """Once per model: set `ATTENTION_NAME` on `config` and keep it if `shared(ids, mask, L, groups)` gives
    `plain(ids, mask, L)` on two prompts (one left-padded) x two responses (one shorter); else restore sdpa and
    say why. With `packed`, the same for the padding-free path: `shared(ids, mask, L)` (packed.py). Only for sdpa models whose layers are all full attention. A sharded model keeps it only where it
    passed on every rank (each rank must call this at the same point)."""
    from ..parallel import agreed

    kinds = set(getattr(config, "layer_types", None) or ["full_attention"])
    reason, switched = None, False
    if config._attn_implementation not in ("sdpa", ATTENTION_NAME):
        reason = f"it uses {config._attn_implementation} attention, not sdpa"
    elif kinds != {"full_attention"}:
        reason = "its layers are " + ", ".join(sorted(kinds))
    else:
        # sdpa for every call that shares no prompt; one set by the other path's check stays (that path uses it)
        switched = config._attn_implementation != ATTENTION_NAME
        config._attn_implementation = ATTENTION_NAME
        device = next(module.parameters()).device
        gen = torch.Generator().manual_seed(0)
        ids = torch.randint(0, min(config.vocab_size, 1000), (4, 9), generator=gen).to(device)
        mask = torch.ones_like(ids)
        mask[2:, :2] = 0  # the second prompt is left-padded
        mask[1, -1] = 0  # one response is shorter
        ids[1] = torch.where(mask[1].bool(), ids[1], 0)
        ids[1, :5], ids[3, :5] = ids[0, :5], ids[2, :5]
        groups = (torch.tensor([0, 2]), torch.tensor([0, 0, 1, 1]))
        try:
            with eval_mode(module), torch.no_grad(), output_dtypes() as computed_in:
                other = shared(ids, mask, 4) if packed else shared(ids, mask, 4, groups)
                error = float((plain(ids, mask, 4).float() - other.float()).abs().max())
            allowed = 5e-2 if computed_in & HALF_DTYPES else 1e-4
            if error > allowed:
                reason = f"its {what} differ from the plain forward's by {error:.1e}"
            log.debug("%s of %s, %s: %.1e from the plain forward's (%.0e allowed)", what, type(module).__name__,
                      "packed" if packed else "prompts shared", error, allowed)
        except Exception as exc:  # an architecture whose modules the shared path cannot drive
            reason = f"{type(exc).__name__}: {exc}"
    if not agreed(reason is None, module) and reason is None:  # a sharded model's ranks all take one path
        reason = "the check failed in another process"
    if reason and switched:
        config._attn_implementation = "sdpa"
    if reason:
        log.warning("%s of %s: computed %s (%s)", what, type(module).__name__,
                    "on padded rows" if packed else "without sharing prompts", reason)
    return reason is None


HALF_DTYPES = frozenset({torch.bfloat16, torch.float16})


@contextlib.contextmanager
def output_dtypes():
    """The set of dtypes of the floating-point tensors that modules called inside return: what a forward computes
    in, whether autocast set it or FSDP's mixed precision (which casts the weights and leaves autocast off)."""
    seen: set[torch.dtype] = set()

    def record(module, args, output):
        if isinstance(output, torch.Tensor) and output.is_floating_point():
            seen.add(output.dtype)

    handle = torch.nn.modules.module.register_module_forward_hook(record)
    try:
        yield seen
    finally:
        handle.remove()


def leading_padding(mask: torch.Tensor) -> int:
    """How many leading columns of a left-padded (rows, T) mask are padding in every row, leaving at least one
    column: what a pass over those rows need not compute."""
    used = mask.bool().any(dim=0).nonzero()
    return min(int(used[0]) if len(used) else mask.shape[1], mask.shape[1] - 1)


def prompt_groups(uids: list) -> tuple[torch.Tensor, torch.Tensor]:
    """(first row of each distinct prompt, each row's prompt index) from the rows' group ids."""
    index: dict = {}
    firsts, row_prompt = [], []
    for row, u in enumerate(uids):
        if u not in index:
            index[u] = len(firsts)
            firsts.append(row)
        row_prompt.append(index[u])
    return torch.tensor(firsts), torch.tensor(row_prompt)


@contextlib.contextmanager
def attention_implementation(config, name: str):
    """The model's attention modules read `config._attn_implementation` at every call: switch it for a block."""
    before = config._attn_implementation
    config._attn_implementation = name
    try:
        yield
    finally:
        config._attn_implementation = before
