"""What a request asks of the scheduler (`RequestSampling`), its samples as rows of the decoding batch, and how a
batch of rows draws its next tokens.

Sampling: rows of requests asking the same temperature / top-p / top-k and no seed are sampled in one call; a
request with a seed draws from its own generator, so the same seed and prompt give the same tokens whatever else is
running (up to the rounding of the logits, which a batch's shape may change). Each sampled token's log-prob under
the distribution it was drawn from is always computed (recorded calls become training episodes). Rows with
logits processing (processors.py: penalties, biases, masks, grammars) are sampled apart, after it; the plain rows'
one batched call stays as it was. Clients are shown log-probs under the model's raw distribution (vLLM's default
`logprobs_mode`), computed only for the rows of requests that ask for them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from ..rollout.base import SamplingParams
from ..rollout.sampling import next_tokens, sampled_logprobs
from . import processors
from .handle import Handle
from .processors import Processing

# per kind of request: its sampling parameters, its rows (None: every row), its generator, its rows' processing
Plan = list[tuple[SamplingParams, "torch.Tensor | None", "torch.Generator | None", "list | None"]]


@dataclass(frozen=True)
class RequestSampling:
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: no top-k
    max_tokens: int = 256  # new tokens per sample
    seed: int | None = None  # same seed + same request -> same tokens
    stop_token_ids: tuple[int, ...] = ()  # besides the model's EOS ids
    ignore_eos: bool = False  # the model's EOS ids do not end a sample (stop_token_ids still do)
    processing: Processing | None = None  # penalties, biases, masks, grammar, top log-probs (processors.py)
    prompt_logprobs: int | None = None  # echo: the prompt's log-probs (and this many top ones) onto the handle
    logprobs: bool = False  # the client is shown log-probs: each token's under the model's raw distribution too


class Request:
    def __init__(self, handle: Handle, prompt: list[int], sampling: RequestSampling, stops: frozenset[int],
                 device):
        self.handle, self.prompt, self.sampling, self.stops = handle, prompt, sampling, stops
        self.live = set(range(handle.n))  # samples that have not ended (the scheduler thread's, once admitted)
        s = sampling
        self.params = SamplingParams(do_sample=s.temperature > 0, temperature=s.temperature if s.temperature > 0
                                     else 1.0, top_p=s.top_p, top_k=s.top_k)
        self.generator = (None if s.seed is None or not self.params.do_sample
                          else torch.Generator(device).manual_seed(s.seed))
        # rows sharing a sampling call: greedy rows all together, sampled ones by their filters, seeded ones alone
        self.kind = ("greedy",) if not self.params.do_sample else (
            ("seeded", id(self)) if self.generator is not None else (s.temperature, s.top_p, s.top_k))
        if s.processing is not None:  # processed rows are sampled apart: the plain rows' call stays as it was
            self.kind = ("processed",) + self.kind
        # drawn from the model's own distribution (greedy or temperature 1, nothing filtered): its sampling log-prob
        # is the raw one clients are shown
        self.raw = s.processing is None and (not self.params.do_sample or (
            s.temperature == 1.0 and s.top_p >= 1.0 and s.top_k <= 0))
        self.version = 0  # the prefix cache's weight version when it joined (scheduler._join)
        self.queued = time.monotonic()  # when it was submitted (the scheduler gathers a burst: scheduler.py)


class Row:
    __slots__ = ("request", "sample", "count", "tokens", "processing")

    def __init__(self, request: Request, sample: int):
        self.request, self.sample, self.count = request, sample, 0
        self.tokens: list[int] = []  # sampled so far
        p, params = request.sampling.processing, request.params
        self.processing = None if p is None else p.start(request.prompt, request.stops, params.temperature,
                                                         params.greedy)


def sampling_plan(rows: list[Row], device) -> Plan:
    """One sampling call per kind of request among `rows` (the batch's rows, in order)."""
    kinds: dict[tuple, list[int]] = {}
    for j, row in enumerate(rows):
        kinds.setdefault(row.request.kind, []).append(j)
    return [(rows[js[0]].request.params, None if len(kinds) == 1 else torch.tensor(js, device=device),
             rows[js[0]].request.generator,
             None if rows[js[0]].processing is None else [rows[j].processing for j in js])
            for js in kinds.values()]


def sample(logits: torch.Tensor, plan: Plan) -> tuple[torch.Tensor, torch.Tensor, dict | None]:
    """Each row's next token, its log-prob, and the top log-probs of rows that ask (row -> entries; None when no
    row asks): one sampling call per kind of request; processed rows have their logits adjusted first."""
    if len(plan) == 1 and plan[0][3] is None:
        s, _, generator, _ = plan[0]
        token = next_tokens(logits, s, generator)
        return token, sampled_logprobs(logits, token, s), None
    token = torch.empty(len(logits), dtype=torch.long, device=logits.device)
    logprob = torch.empty(len(logits), dtype=torch.float32, device=logits.device)
    tops: dict[int, list] = {}
    for s, js, generator, states in plan:
        part = logits if js is None else logits.index_select(0, js)
        if states is None:
            t = next_tokens(part, s, generator)
            lp = sampled_logprobs(part, t, s)
        else:
            t, lp, top = processors.sample(part, s, generator, states)
            at = range(len(states)) if js is None else js.tolist()
            tops.update((j, entries) for j, entries in zip(at, top) if entries is not None)
        if js is None:
            token, logprob = t, lp.float()
        else:
            token[js], logprob[js] = t, lp
    return token, logprob, tops or None


def raw_logprobs(rows: list[Row], logits: torch.Tensor, token: torch.Tensor,
                 logprob: list[float]) -> list[float | None] | None:
    """Each row's token's log-prob under the model's own distribution (its raw logits, before any processing,
    temperature or filter: what clients are shown, as vLLM's default `logprobs_mode`, raw_logprobs), for the rows
    whose request asks for log-probs (None elsewhere; None: no row asks). A row drawn from that distribution itself
    has it already; the others' take one log-softmax over their logits."""
    asking = [j for j, row in enumerate(rows) if row.request.sampling.logprobs]
    if not asking:
        return None
    raw: list[float | None] = [None] * len(rows)
    computed = []
    for j in asking:
        if rows[j].request.raw:
            raw[j] = logprob[j]
        else:
            computed.append(j)
    if computed:
        at = torch.tensor(computed, device=logits.device)
        table = torch.log_softmax(logits.index_select(0, at).float(), dim=-1)
        for j, value in zip(computed, table.gather(-1, token.index_select(0, at).unsqueeze(-1)).flatten().tolist()):
            raw[j] = value
    return raw
