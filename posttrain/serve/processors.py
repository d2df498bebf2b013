"""Per-request logits processing: the request fields that change the distribution a sample is drawn from, applied to
the raw logits of the rows that ask for them, in the order vLLM applies them (before temperature):

1. a grammar's token mask (structured output, structured.py);
2. `allowed_token_ids`: every other token removed;
3. `bad_words`: a word's last token removed where the tokens just sampled are the word's other tokens;
4. `min_tokens`: the stop tokens (EOS unless `ignore_eos`, and `stop_token_ids`) removed until that many tokens are out;
5. `logit_bias`: added (token id -> bias);
6. `repetition_penalty` (CTRL's, as transformers and vLLM apply it): a token of the prompt or of the output so far has
   a positive logit divided by it and a negative one multiplied; then OpenAI's `frequency_penalty` (minus the penalty
   times the token's count in the output so far) and `presence_penalty` (minus the penalty once the token occurs);
7. `min_p` (vLLM applies it after temperature, before top-k / top-p): tokens less likely than `min_p` times the
   likeliest are removed. On the unscaled logits that is `logit < max + T * log(min_p)` (T the temperature), so it
   is applied here; greedy rows skip it, as vLLM's do (it never changes the argmax).

Temperature, top-k and top-p follow in rollout/sampling.py, on the processed logits, and the sampled token's log-prob
is of that processed distribution (the one it was drawn from). A row left with no token at all (a grammar that can
only end where `min_tokens` forbids ending) gets its stop tokens back, so it ends instead of drawing from nothing.

Rows that ask for none of this are never passed here: the scheduler samples them as before (requests.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..rollout.sampling import next_tokens, sampled_logprobs

NEG_INF = float("-inf")


@dataclass(frozen=True)
class Processing:
    """What one request asks for (the app builds it from the request, requests.py); neutral values do nothing."""
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0
    min_p: float = 0.0
    allowed_token_ids: tuple[int, ...] = ()
    bad_words: tuple[tuple[int, ...], ...] = ()  # token id sequences
    grammar: object | None = None  # structured.Grammar
    top_logprobs: int = 0  # each position's most likely tokens and their log-probs, reported beside the sampled one

    @property
    def penalises(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)

    def start(self, prompt: list[int], stops, temperature: float, greedy: bool) -> "RowState":
        return RowState(self, prompt, stops, temperature, greedy)


class RowState:
    """One sample's processing state: its tokens so far and its grammar's parser."""

    def __init__(self, processing: Processing, prompt: list[int], stops, temperature: float, greedy: bool):
        self.processing, self.prompt, self.stops = processing, prompt, sorted(stops)
        self.temperature, self.greedy = temperature, greedy
        self.generated: list[int] = []
        self.matcher = processing.grammar.matcher() if processing.grammar is not None else None
        self._masks: dict = {}  # (what, device) -> a (V,) tensor made once

    def advance(self, token: int) -> None:
        self.generated.append(token)
        if self.matcher is not None:
            self.matcher.consume_token(token)  # masked logits leave only tokens the grammar takes

    def _mask(self, what: str, vocab: int, device) -> torch.Tensor:
        """(V,) bool: the prompt's tokens ("prompt") or the tokens not allowed ("disallowed")."""
        key = (what, vocab, str(device))
        if key not in self._masks:
            ids = self.prompt if what == "prompt" else self.processing.allowed_token_ids
            mask = torch.zeros(vocab, dtype=torch.bool, device=device)
            mask[torch.tensor([t for t in ids if 0 <= t < vocab], dtype=torch.long, device=device)] = True
            self._masks[key] = mask if what == "prompt" else ~mask
        return self._masks[key]

    def banned_words(self) -> list[int]:
        """The last token of each bad word whose other tokens were just sampled (vLLM's rule)."""
        out = []
        for word in self.processing.bad_words:
            before = len(word) - 1
            if before == 0 or (len(self.generated) >= before and tuple(self.generated[-before:]) == word[:-1]):
                out.append(word[-1])
        return out


def grammar_masks(matchers: list, vocab: int) -> torch.Tensor:
    """(G, V) bool: the tokens each grammar allows next (llguidance's bitmask: bit j of word i is token 32 i + j)."""
    words = torch.stack([torch.frombuffer(bytearray(m.compute_bitmask()), dtype=torch.int32) for m in matchers])
    bits = (words.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
    allowed = bits.reshape(len(matchers), -1).bool()
    if allowed.shape[1] < vocab:
        allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[1]))
    return allowed[:, :vocab]


def adjust(logits: torch.Tensor, states: list[RowState]) -> torch.Tensor:
    """float32 (R, V): `logits` (R, V) of rows `states` after their processing (the module docstring's order). The
    input is not changed."""
    x = logits.float()
    x = x.clone() if x is logits else x
    vocab, device = x.shape[-1], x.device
    rows = range(len(states))

    grammar = [i for i in rows if states[i].matcher is not None]
    if grammar:
        allowed = grammar_masks([states[i].matcher for i in grammar], vocab).to(device)
        at = torch.tensor(grammar, device=device)
        x[at] = x[at].masked_fill(~allowed, NEG_INF)
    for i, s in enumerate(states):
        p = s.processing
        if p.allowed_token_ids:
            x[i].masked_fill_(s._mask("disallowed", vocab, device), NEG_INF)
        banned = s.banned_words() if p.bad_words else []
        if len(s.generated) < p.min_tokens:
            banned += s.stops
        if banned:
            x[i, torch.tensor(banned, device=device)] = NEG_INF
        if p.logit_bias:
            ids, bias = zip(*p.logit_bias)
            x[i].index_add_(0, torch.tensor(ids, device=device), torch.tensor(bias, device=device))

    penalised = [i for i in rows if states[i].processing.penalises]
    if penalised:
        x[torch.tensor(penalised, device=device)] = _penalties(x[penalised], [states[i] for i in penalised])

    thinned = [i for i in rows if states[i].processing.min_p > 0 and not states[i].greedy]
    if thinned:
        at = torch.tensor(thinned, device=device)
        part = x[at]
        floor = torch.tensor([[s.temperature * math.log(s.processing.min_p)] for s in (states[i] for i in thinned)],
                             device=device)
        x[at] = part.masked_fill(part < part.max(dim=-1, keepdim=True).values + floor, NEG_INF)

    dead = (~(x > NEG_INF).any(dim=-1)).nonzero().flatten().tolist()
    for i in dead:  # nothing left to draw: the sample may end (with no stop token at all: the model's own logits)
        if states[i].stops:
            x[i, torch.tensor(states[i].stops, dtype=torch.long, device=device)] = 0.0
        else:
            x[i] = logits[i].float()
    return x


def _penalties(x: torch.Tensor, states: list[RowState]) -> torch.Tensor:
    """Repetition (prompt + output), then frequency and presence (output) penalties of rows `states` on `x`."""
    vocab, device = x.shape[-1], x.device
    counts = torch.zeros_like(x)
    row = torch.tensor([i for i, s in enumerate(states) for _ in s.generated], dtype=torch.long, device=device)
    token = torch.tensor([t for s in states for t in s.generated], dtype=torch.long, device=device)
    counts.index_put_((row, token), torch.ones(len(token), device=device), accumulate=True)

    def column(values) -> torch.Tensor:
        return torch.tensor(values, dtype=x.dtype, device=device).unsqueeze(1)

    repetition = [s.processing.repetition_penalty for s in states]
    if any(r != 1.0 for r in repetition):
        seen = (counts > 0) | torch.stack([s._mask("prompt", vocab, device) for s in states])
        r = column(repetition)
        x = torch.where(seen, torch.where(x > 0, x / r, x * r), x)
    x = x - column([s.processing.frequency_penalty for s in states]) * counts
    return x - column([s.processing.presence_penalty for s in states]) * (counts > 0)


def top_entries(table: torch.Tensor, ks: list[int]) -> list[list[tuple[int, float]] | None]:
    """Per row of the log-prob table (R, V), its `ks[r]` most likely (token, log-prob), most likely first (None where
    0)."""
    k = max(ks)
    if k <= 0:
        return [None] * len(ks)
    values, ids = table.topk(min(k, table.shape[-1]), dim=-1)
    values, ids = values.tolist(), ids.tolist()
    return [list(zip(ids[r][:kr], values[r][:kr])) if kr > 0 else None for r, kr in enumerate(ks)]


def sample(logits: torch.Tensor, s, generator, states: list[RowState]):
    """Rows `states` (logits (R, V)): their logits processed, then drawn as plain rows are (rollout/sampling.py);
    their tokens (R,), log-probs (R,) of the processed distribution (the one drawn from, which training records),
    and top log-probs (per row, None where not asked) of the model's raw distribution, the one clients are shown
    (as vLLM's default `logprobs_mode`, raw_logprobs: requests.raw_logprobs). Each state is advanced by its
    token."""
    x = adjust(logits, states)
    token = next_tokens(x, s, generator)
    logprob = sampled_logprobs(x, token, s)
    asked = [st.processing.top_logprobs for st in states]
    tops = top_entries(torch.log_softmax(logits.float(), dim=-1), asked) if any(asked) else [None] * len(states)
    for state, t in zip(states, token.tolist()):
        state.advance(t)
    return token, logprob, tops


def score_prompt(engine, model, prompt: list[int], top: int) -> list[tuple[float | None, list | None]]:
    """`echo`: each prompt token's log-prob under the model (temperature 1, no processing: the prompt is given, not
    sampled) and its `top` most likely tokens there; the first token has neither. Runs in the scheduler's thread on
    the decoding weights, with the model's own attention (as a prefill), the log-probs computed in chunks."""
    from ..models.logprobs import response_logprobs

    if len(prompt) < 2:
        return [(None, None)]
    ids = torch.tensor([prompt], device=engine.device)
    with engine._prefilling(model):
        out = response_logprobs(getattr(model, "lm", model), ids, torch.ones_like(ids), len(prompt) - 1,
                                with_entropy=False, extra_tokens=top or None)
    logprobs = out[0][0].tolist()
    if not top:
        return [(None, None)] + [(lp, None) for lp in logprobs]
    values, tokens = (x[0].tolist() for x in out[2])
    return [(None, None)] + [(lp, list(zip(t, v))) for lp, t, v in zip(logprobs, tokens, values)]
