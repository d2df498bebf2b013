"""posttrain's decoding engine: the model's own modules, driven by a short loop built for RL sampling.

What it does differently from transformers' `generate` (each measured in docs/performance.md):
- the `n` samples of a prompt share it: the prompt is prefilled once, and its keys and values are read once per
  step for all `n` samples (prefix_attention.py);
- prompts are prefilled in buckets of similar length, not all padded to the longest (prefill.py);
- generated keys and values go into preallocated buffers (no concatenation of the whole cache per token);
- finished rows are dropped from the batch once a quarter of it has finished;
- sampling is one inverse-CDF draw per row over filtered logits (sampling.py); decoding runs on weights already in the
  compute dtype (weights.py);
- on a GPU each decoding step is replayed as a CUDA graph (cuda_graphs.py; `rollout.enforce_eager=True` turns that
  off); finished rows are then dropped once half the batch has finished, since each compaction records a new graph.

Everything a run holds (rows, their keys and values, their positions) is one `DecodeState` (decode_state.py);
`start`, `step`, `add` and `extend` are the operations on it that `generate` and callers decoding sequence by
sequence (multi-turn episodes, requests joining a running batch) use.

Any model runs: the first call checks (self_check.py) that this loop gives the logits of the model's own forward;
a model it does not match (an attention variant the shared-prefix step does not implement) is decoded by
transformers' `generate` instead, with one note.
"""

from __future__ import annotations

import contextlib
import functools
import inspect

import torch

from ..models.load import attention_backends, autocast, eval_mode
from ..models.logprobs import _unwrap
from ..models.moe import router_off
from ..models.shared_prompt import attention_implementation, leading_padding
from ..parallel import is_sharded
from .base import RolloutEngine, SamplingParams
from .cuda_graphs import DecodeStep
from .decode_state import DecodeState
from .kv_blocks import BlockPool, BlockSequence
from .paged_state import PagedDecodeState
from .prefill import prefill, prefill_after
from .prefix_attention import ATTENTION_NAME
from .routing import EngineRouting
from .sampling import next_tokens, sampled_logprobs
from .self_check import check, check_paged, compare, compare_paged
from .transformers_generate import generate_with_transformers
from .weights import inference_weights

DROP_FINISHED_SHARE = 0.25  # drop finished rows once they are this share of the batch
STATIC_DROP_FINISHED_SHARE = 0.5  # the same with CUDA graphs (a compacted batch is recorded anew)


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


class DecodeEngine(RolloutEngine):
    """generate(batch, sampling) as `RolloutEngine` says; see the module docstring."""

    def __init__(self, model, tokenizer, *, device, dtype, micro_batch_size: int | None = None,
                 cuda_graphs: bool = True):
        super().__init__(model, tokenizer, device=device, dtype=dtype, micro_batch_size=micro_batch_size)
        self.shared_prefix_ok: bool | None = None  # decided by the first call's check
        self.paged_ok: bool | None = None  # the paged state's check (a server's), made when first asked
        # CUDA graphs: on a GPU unless turned off; not for a sharded model (its forward gathers weights) nor a MoE
        # model (its expert loop asks the CPU which experts were hit: `nonzero`, which a graph cannot record).
        # `static` runs the same static-buffer loop without recording (how the tests drive that loop on a CPU).
        self.cuda_graphs = (cuda_graphs and torch.device(device).type == "cuda" and not is_sharded(model)
                            and not router_off(model.config))
        self.static = self.cuda_graphs
        self.graphs_recorded = 0  # CUDA graphs recorded by the last call
        self._plain_attention: str | None = None  # the model's own attention, while `decoding` has switched it
        # router replay R3 (rollout/routing.py): while True, each chunk's routing table is appended to
        # `routing_tables` (chunks in row order); the caller sets, reads and clears both
        self.record_routing = False
        self.routing_tables: list[torch.Tensor] = []

    def prepare(self, model) -> None:
        """The self-check, once: every rank of a sharded model runs it in the same call (its verdict is agreed)."""
        if self.shared_prefix_ok is None:
            self.shared_prefix_ok = self._check(model)

    def _generate(self, model, prompts: torch.Tensor, prompt_mask: torch.Tensor, s: SamplingParams, *,
                  images: list | None = None):
        self.prepare(model)
        if not self.shared_prefix_ok:
            if self.record_routing:
                raise RuntimeError("router replay R3 records the routing in posttrain's decoding loop, and this model "
                                   "is decoded by transformers' generate (its self-check failed: see the warning "
                                   "above); use router_replay.mode=R2")
            return generate_with_transformers(model, prompts, prompt_mask, s, device=self.device, dtype=self.dtype,
                                              eos_ids=self.eos_ids, pad_id=self.pad_id, images=images)
        # the sampling noise comes from torch's global generator (the trainer seeds it per step and rank)
        generator = None if s.greedy else torch.Generator(self.device).manual_seed(int(torch.randint(0, 2**62, (1,))))
        with eval_mode(model), torch.no_grad(), autocast(self.device, self.dtype):
            tokens, logprobs = self._decode(model, prompts[:: s.n], prompt_mask[:: s.n], s, generator,
                                            routing=self.record_routing)
        return tokens.cpu(), (logprobs.cpu() if logprobs is not None else None)

    # ------------------------------------------------------------------ the operations on a decoding state
    # (run on the decoding weights under torch.no_grad(), as `_generate` runs `_decode`)

    def _prefill(self, model, prompts: torch.Tensor, mask: torch.Tensor, n: int, max_new: int, static: bool, *,
                 call_cost: int | None = None, first_capacity: int | None = None):
        """Last-position logits (prompts, V), and the decoding state holding the prompts' keys and values, `n`
        rows per prompt. The state keeps the batch's width (zeros on padding, which its prefix bias masks)."""
        with self._prefilling(model):
            logits, keys, values = prefill(_forward(model), model.config, prompts, mask, call_cost)
        return logits, DecodeState(keys, values, mask, n, max_new, static=static, first_capacity=first_capacity)

    def start(self, model, prompts: torch.Tensor, mask: torch.Tensor, n: int, max_new: int, *,
              share_prefix: bool = True):
        """A new decoding state for left-padded `prompts` (B, P), `n` rows each (ids 0 .. B*n-1), and their first
        logits (B*n, V). `share_prefix=False`: each row gets its own copy of its prompt's keys and values (the
        prompt is still computed once) — for runs whose rows are parked and resumed one by one (multi-turn
        episodes), where a resumed row is a slot of its own and a slot shared by `n` rows would compute `n` rows'
        prefix products for it. Such a run decodes eagerly: its layout changes at every park and resume, and a
        CUDA graph is recorded per layout."""
        if not share_prefix:
            return self.start_slots(model, prompts, mask, 1, max_new, copies=n)
        prompts, mask = prompts.to(self.device), mask.to(self.device)
        logits, state = self._prefill(model, prompts, mask, n, max_new, self.static)
        if self.static:
            state.graph = DecodeStep(_forward(model), graphs=self.cuda_graphs)
        return logits.repeat_interleave(n, dim=0), state

    def start_slots(self, model, prompts, mask: torch.Tensor | None, group: int, max_new: int, *,
                    copies: torch.Tensor | int | None = None, rows: torch.Tensor | None = None, pasts=None,
                    paged: bool = False, pool: BlockPool | None = None):
        """A new decoding state of `group` rows per slot, decoding eagerly, and its rows' first logits: `copies`,
        `rows` and `pasts` as `add` takes them (a run whose layout changes as rows come and go: a server's
        requests). `paged`: a `PagedDecodeState` on `pool` (a new pool when None), whose `pasts` may be held
        `BlockSequence`s (their whole blocks are referenced, not copied)."""
        if paged:
            logits, keys, values, mask = self._slots(model, prompts, mask, None, pasts)
            state = PagedDecodeState(keys, values, mask, group, pool=pool, copies=copies, rows=rows,
                                     reused=_held(pasts))
            return self._paged_logits(logits, state, copies, rows), state
        logits, keys, values, mask = self._slots(model, prompts, mask, copies, pasts)
        state = DecodeState(keys, values, mask, group, max_new)
        if rows is None:
            return logits.repeat_interleave(group, dim=0), state
        rows = rows.to(self.device)
        if bool((rows < group).any()):  # the slots' first `rows` rows only
            slots = torch.arange(len(rows), device=self.device)
            firsts = rows.cumsum(0) - rows
            within = torch.arange(int(rows.sum()), device=self.device) - firsts.repeat_interleave(rows)
            state.keep(slots.repeat_interleave(rows) * group + within)
        return logits.repeat_interleave(rows, dim=0), state

    def _slots(self, model, prompts, mask: torch.Tensor | None, copies: torch.Tensor | int | None, pasts=None):
        """Left-padded `prompts` prefilled (each once) — or, with `pasts`, the token lists `prompts` appended to
        those parked sequences (`prefill_after`) — then `copies` slots of each (one count per prompt, or one for
        all): their last-position logits (slots, V), keys and values per layer, and mask (slots, P)."""
        if pasts is not None:  # held block sequences: their positions as tensors
            pasts = [p.gather() if isinstance(p, BlockSequence) else p for p in pasts]
        with self._prefilling(model):
            if pasts is None:
                prompts, mask = prompts.to(self.device), mask.to(self.device)
                logits, keys, values = prefill(_forward(model), model.config, prompts, mask)
            else:
                logits, keys, values, mask = prefill_after(_forward(model), model.config, pasts,
                                                           [t.to(self.device) for t in prompts])
        if copies is None:
            return logits, keys, values, mask
        copies = copies.to(self.device) if isinstance(copies, torch.Tensor) else copies
        again = lambda xs: [x.repeat_interleave(copies, dim=0) for x in xs]  # noqa: E731
        return logits.repeat_interleave(copies, dim=0), again(keys), again(values), mask.repeat_interleave(copies, 0)

    def step(self, model, state: DecodeState, token: torch.Tensor) -> torch.Tensor:
        """Each row's `token` (rows,) decoded: the next logits (rows, V)."""
        with self.decoding(model):
            return self._step(_forward(model), state, token, state.graph)

    def add(self, model, state: DecodeState, prompts, mask: torch.Tensor | None, ids: torch.Tensor,
            max_new: int, *, copies: torch.Tensor | None = None, rows: torch.Tensor | None = None,
            pasts=None) -> torch.Tensor:
        """Left-padded `prompts` join the run, `state.group` rows each with the caller's `ids`, decoding from the
        next step on for up to `max_new` steps: their first logits (rows, V). The other rows are untouched.
        `copies` (one count per prompt): that many slots per prompt, its keys and values computed once and copied
        into each; `rows` (one count per slot, at most `state.group`): that many rows in each slot (a server's
        requests: the samples of one prompt fill slots of up to `group` rows). `pasts` (one per prompt, as `park`
        gives them; `mask` None): each prompt is a (T,) tensor of tokens appended to that parked sequence, and only
        those are computed (a server's request continuing a conversation whose keys and values it kept)."""
        if isinstance(state, PagedDecodeState):  # each prompt's blocks are referenced by its slots, not copied
            logits, keys, values, mask = self._slots(model, prompts, mask, None, pasts)
            state.add(keys, values, mask, ids, max_new, copies=copies, rows=rows, reused=_held(pasts))
            return self._paged_logits(logits, state, copies, rows)
        logits, keys, values, mask = self._slots(model, prompts, mask, copies, pasts)
        state.add(keys, values, mask, ids, max_new, rows=rows)
        return logits.repeat_interleave(state.group if rows is None else rows.to(self.device), dim=0)

    def _paged_logits(self, logits: torch.Tensor, state: PagedDecodeState, copies, rows) -> torch.Tensor:
        """Each prompt's logits (prompts, V) repeated for its rows: `copies` slots per prompt, `rows` rows per slot."""
        if copies is not None:
            logits = logits.repeat_interleave(copies.to(self.device) if isinstance(copies, torch.Tensor)
                                              else copies, dim=0)
        return logits.repeat_interleave(state.group if rows is None else rows.to(self.device), dim=0)

    def extend(self, model, state: DecodeState, seq_id: int, tokens: torch.Tensor, max_new: int) -> torch.Tensor:
        """Sequence `seq_id` continues after `tokens` (T,) appended to what the state holds of it (a multi-turn
        episode back from its tools: its last sampled token, if kept, then the tool's output); only those T tokens
        are computed. It becomes the last row; its logits after the last appended token (1, V)."""
        return self.resume(model, state, seq_id, self.park(state, seq_id), tokens, max_new)

    def park(self, state: DecodeState, seq_id: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Take sequence `seq_id` out of the decoding batch (an episode waiting for its tools): its keys and values
        per layer (1, kv_heads, L, head_dim), which `resume` takes back. The other rows decode on untouched."""
        row = int((state.ids == seq_id).nonzero().squeeze(1)[0])
        past = state.past(row)
        others = torch.arange(len(state.ids), device=state.ids.device)
        state.keep(others[others != row])
        return past

    def resume(self, model, state: DecodeState, seq_id: int, past, tokens: torch.Tensor,
               max_new: int) -> torch.Tensor:
        """A parked sequence (`past`, from `park`) rejoins the batch after `tokens` (T,) appended to it; only those
        T tokens are computed. It becomes the last row, decoding for up to `max_new` steps; its logits after the
        last appended token (1, V)."""
        return self.resume_many(model, state, [(seq_id, past, tokens)], max_new)

    def resume_many(self, model, state: DecodeState, parked: list[tuple[int, object, torch.Tensor]],
                    max_new: int) -> torch.Tensor:
        """`resume` for several parked sequences (seq_id, past, tokens) in one forward: they become the last rows,
        in order; their logits (k, V)."""
        return self.add(model, state, [t for _, _, t in parked], None, torch.tensor([i for i, _, _ in parked]),
                        max_new, rows=torch.ones(len(parked), dtype=torch.long), pasts=[p for _, p, _ in parked])

    @contextlib.contextmanager
    def decoding(self, model):
        """The model's attention switched to the shared-prefix decoding step for a block."""
        if self._plain_attention is not None:  # already switched
            yield
            return
        self._plain_attention = model.config._attn_implementation
        try:
            with attention_implementation(model.config, ATTENTION_NAME):
                yield
        finally:
            self._plain_attention = None

    def _prefilling(self, model):
        """The model's own attention, also inside `decoding` (prompts and appended tokens are prefilled with it)."""
        if self._plain_attention is None:
            return contextlib.nullcontext()
        return attention_implementation(model.config, self._plain_attention)

    @staticmethod
    def _step(forward, state: DecodeState, token: torch.Tensor, graph: DecodeStep | None = None) -> torch.Tensor:
        """`token` written at each row's position by one forward (replayed by `graph` in static mode); the
        state advanced; the next logits."""
        if graph is not None:
            logits = graph(token, state.positions, state)
        else:
            logits = forward(input_ids=token[:, None], position_ids=state.positions[:, None], cache=state,
                             use_cache=True, shared_prefix=state).logits[:, -1]
        state.advance()
        return logits

    # ------------------------------------------------------------------ one generate call

    def _decode(self, model, prompts: torch.Tensor, mask: torch.Tensor, s: SamplingParams,
                generator: torch.Generator | None = None, forced: torch.Tensor | None = None,
                on_logits=None, *, call_cost: int | None = None,
                first_capacity: int | None = None, routing: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(prompts * n, max_new) tokens, and their sampling log-probs when `s.logprobs` (else None). `forced`
        (rows, steps) replaces the sampled tokens and `on_logits(t, ids, logits)` sees each step's logits of the
        rows `ids`; with `call_cost` (prefill buckets) and `first_capacity` (suffix buffers) they let the
        self-check (self_check.py) drive every path of the loop on a few tokens. `routing`: record every token's
        experts (R3 router replay) into `routing_tables`."""
        device, static = self.device, self.static
        forward = _forward(model)
        graph = DecodeStep(forward, graphs=self.cuda_graphs) if static else None
        drop_share = STATIC_DROP_FINISHED_SHARE if static else DROP_FINISHED_SHARE
        prompts, mask = prompts.to(device), mask.to(device)
        start = leading_padding(mask)  # columns that are padding in every prompt are not computed
        prompts, mask = prompts[:, start:], mask[:, start:]
        n, steps = s.n, s.max_new_tokens
        capture = EngineRouting(model, mask, n, steps, call_cost) if routing else None
        with capture.prefill() if capture is not None else contextlib.nullcontext():
            logits, state = self._prefill(model, prompts, mask, n, steps, static, call_cost=call_cost,
                                          first_capacity=first_capacity)
        logits = logits.repeat_interleave(n, dim=0)
        rows = len(prompts) * n
        tokens = torch.full((rows, steps), self.pad_id, dtype=torch.long, device=device)
        logprobs = torch.zeros((rows, steps), dtype=torch.float32, device=device) if s.logprobs else None
        finished = torch.zeros(rows, dtype=torch.bool, device=device)
        eos = torch.tensor(sorted(self.eos_ids), device=device)
        with self.decoding(model), capture.decoding() if capture is not None else contextlib.nullcontext():
            for t in range(steps):
                if on_logits is not None:
                    on_logits(t, state.ids, logits)
                token = next_tokens(logits, s, generator) if forced is None else forced[state.ids, t]
                tokens[state.ids, t] = token
                if logprobs is not None:
                    logprobs[state.ids, t] = sampled_logprobs(logits, token, s)
                if t == steps - 1:
                    break
                if not s.ignore_eos:
                    finished |= torch.isin(token, eos)
                    done = int(finished.sum())
                    if done == len(state.ids):
                        break
                    if done >= drop_share * len(state.ids):
                        keep = (~finished).nonzero().squeeze(1)
                        token, finished = token[keep], finished[keep]
                        state.keep(keep)
                self._weights_version(model)  # partial rollouts: newer weights may arrive between two steps
                if capture is not None:
                    capture.step(state.ids)
                logits = self._step(forward, state, token, graph)
        if graph is not None:
            self.graphs_recorded = graph.recorded
        if capture is not None:
            self.routing_tables.append(capture.table())
        return tokens, logprobs

    def check_paged(self) -> bool:
        """Does the paged state (a server's) decode as the model does? Checked once, on the decoding weights."""
        if self.paged_ok is None:
            self.ready()
            if not self.shared_prefix_ok:
                self.paged_ok = False
            else:
                device = torch.device(self.device)
                with inference_weights(self.model, self.dtype) as model, attention_backends(device):
                    self.paged_ok = check_paged(self, model)
        return self.paged_ok

    def _check(self, model) -> bool:
        return check(self, model)

    def _compare(self, model) -> str | None:
        return compare(self, model, _forward(model))

    def _compare_paged(self, model) -> str | None:
        return compare_paged(self, model, _forward(model))


def _held(pasts) -> list | None:
    """The held block sequences among `pasts` (None where a past is tensors), for a paged state to reference."""
    if pasts is None:
        return None
    return [p if isinstance(p, BlockSequence) else None for p in pasts]
