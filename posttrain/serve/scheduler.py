"""Continuous batching over posttrain's decoding engine: the server's requests decode together in one batch.

One thread owns the engine and its decoding state (rollout/paged_state.py). Between two decoding steps, the
requests that arrived join the batch (their prompts prefilled in one forward, `engine.add`; a burst still arriving
is gathered first: `GATHER_QUIET_S`) and the samples that ended leave it (`state.keep`); every other row decodes on
untouched. A consumer reads each sample's tokens as they
come (`Handle.events`, or `Handle.aevents` on an event loop).

Layout: the samples of a prompt joining together (a request's `n`, and requests with the same prompt, as the `n`
episodes of one RL row open with) share it: the prompt is prefilled once and its keys and values fill slots of up to
`SLOT_ROWS` rows, each slot's prompt read once per step for all its rows (paged_state.py). A slot with fewer rows (a
chat request's n is 1) computes the empty rows' part of the prefix product on zeros, so a decoding state takes as
many rows per slot as the most samples of one prompt among the requests that open it (up to `SLOT_ROWS`), kept until
the batch empties. Measured on benchmarks/grpo_step.py's M model on a CPU, 64 requests: same 300-token prompt, 4 rows
per slot give 0.9x the tokens/s of an offline batch sharing the prompt (1 row per slot: 0.74x); distinct prompts, 4
rows per slot cost ~5% against 1 (8 rows: ~9%), 0.98x an offline batch of the same prompts; on the S model, with
shorter prompts, 4 rows per slot cost ~18% against 1 (a decoding step of 64 rows: 12.5 ms against 10). Decoding is eager (no CUDA graphs): the batch's layout changes whenever a request joins or leaves.

Keys and values live in blocks of 16 positions (rollout/kv_blocks.py): a row holds the blocks its tokens fill and
gives them back when it leaves (nothing reserved for `max_tokens`, no columns held for rows that came before it); a
prompt's slots hold its blocks, not copies; a kept sequence's blocks are referenced by the requests resuming it. A
decoding step reads a working copy of the blocks in the contiguous layout (rollout/paged_state.py says why), so it
costs what a contiguous step costs (docs/performance.md, "Keys and values in blocks"). `paged=False` runs the
contiguous state (for comparison; also what a model failing the engine's paged check is served on).

Sampling: requests.py (rows of the same kind of request are sampled in one call).

Prefix cache (prefix_cache.py): when a sample ends ("stop" or "length"), its blocks are kept (a reference) under its
token ids (prompt + sampled tokens but the last, whose key and value were never computed); a request whose prompt
shares at least `MIN_REUSED_TOKENS` leading tokens with a kept sequence resumes from those keys and values and
prefills only the rest (`engine.add(..., pasts=)`: the resumed prompts joining together in one forward, beside the
new ones' prefill; its `n` samples share the resumed slot as they share a prefilled one). Agent programs' calls
extend the previous call's prompt + completion, so each turn computes its new messages only. `stats` counts it.

Failures: a prompt whose prefill raises ends its own request (finish "error"; prompts prefilled together are then
retried one by one); a decoding step that raises ends the requests in the batch; the scheduler serves on.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import threading
import time

import torch

from ..models.load import attention_backends, autocast, eval_mode
from ..rollout.weights import inference_weights
from . import processors
from .handle import Event, Handle, _Wakes
from .prefix_cache import PrefixCache
from .requests import Plan, Request, RequestSampling, Row, raw_logprobs, sample, sampling_plan

__all__ = ["PromptTooLong", "QueueFull", "Request", "RequestSampling", "Scheduler", "SLOT_ROWS"]

log = logging.getLogger(__name__)

SLOT_ROWS = 4  # rows per prompt slot (the module docstring says why 4)
# A burst of requests (clients answered together send their next ones together) joins in few prefills: a prompt
# prefilled alone costs about what a dozen cost together. While requests keep arriving, the waiting ones join once a
# decoding step (or, with nothing decoding, GATHER_QUIET_S) has passed without a new one, or once the first of them
# has waited GATHER_MAX_S.
GATHER_QUIET_S = 0.002
GATHER_MAX_S = 0.05


class QueueFull(Exception):
    """More requests would wait than the scheduler's `max_waiting`."""


class PromptTooLong(ValueError):
    """The prompt and `max_tokens` go past the model's context."""


class Scheduler:
    """Serves requests on `engine` (a `rollout.engine.DecodeEngine`) from one thread (`start`): at most
    `max_running` rows (samples) decode at once; at most `max_waiting` requests wait for room (then `QueueFull`).
    `prefix_cache_tokens`: the most tokens whose keys and values are kept for requests that continue a sequence
    (0: none; the module docstring says how). `paged`: keys and values in blocks (the module docstring says why;
    False: the contiguous state rollout's `generate` runs on, kept for comparison)."""

    def __init__(self, engine, *, max_running: int = 64, max_waiting: int = 256, prefix_cache_tokens: int = 32768,
                 paged: bool = True):
        if not all(hasattr(engine, op) for op in ("start", "add", "step", "decoding")):
            raise TypeError(f"the server decodes with posttrain's engine (rollout.name=posttrain), not "
                            f"{type(engine).__name__}")
        if max_running < 1 or max_waiting < 0:
            raise ValueError(f"max_running={max_running} must be >= 1 and max_waiting={max_waiting} >= 0")
        engine.ready()
        if not engine.shared_prefix_ok:
            raise ValueError(f"{type(engine.model).__name__} does not decode with posttrain's shared-prefix step "
                             f"(its self-check failed; the log says why), which continuous batching needs")
        if paged and not engine.check_paged():  # the log says why
            paged = False
        self.engine, self.max_running, self.max_waiting, self.paged = engine, max_running, max_waiting, paged
        self._pool = None  # paged: the block pool, made with the first state, kept while the scheduler lives
        self._cache = PrefixCache(prefix_cache_tokens) if prefix_cache_tokens else None
        self._counts = dict(requests=0, prompt_tokens=0, prefix_cache_hits=0, prefix_cache_tokens_reused=0)
        config = engine.model.config.get_text_config()
        self._context = getattr(config, "max_position_embeddings", None)
        self._vocab = config.vocab_size
        self._cond = threading.Condition()
        self._waiting: collections.deque[Request] = collections.deque()
        self._cancels: list[tuple[Handle, int | None]] = []  # of admitted requests: the thread ends their rows
        self._submitted = 0  # requests queued so far; `_seen`: as many as the last look at the queue found
        self._seen = 0
        self._pauses = 0
        self._busy = False  # the thread holds the decoding weights (a step may run)
        self._closed = False
        self._thread: threading.Thread | None = None
        # the scheduler thread's own: the decoding state, its rows (in the state's order), their next logits
        self._state = None
        self._rows: list[Row] = []
        self._logits: torch.Tensor | None = None
        self._plan: Plan | None = None  # how the rows are sampled (requests.sampling_plan), until they change

    @property
    def stats(self) -> dict:
        """Requests joined, their prompt tokens, the prefix cache's hits, the prompt tokens it spared computing,
        the tokens and sequences it holds now, the sequences it dropped for room; paged: the key/value blocks used
        (by running rows and the cache), free, and shared (held more than once: a prompt's samples, a kept sequence
        and the requests continuing it), and the positions per block."""
        cache = self._cache
        pool = self._pool
        blocks = pool.stats() if pool is not None else dict(kv_blocks_used=0, kv_blocks_free=0, kv_blocks_shared=0,
                                                             kv_block_size=0)
        kept = cache is not None  # (an empty cache is falsy: it has a length)
        return dict(self._counts, requests_waiting=len(self._waiting), samples_running=len(self._rows),
                    prefix_cache_tokens=cache.tokens if kept else 0, prefix_cache_sequences=len(cache) if kept else 0,
                    prefix_cache_evicted=cache.evicted if kept else 0, prefix_cache_stale=cache.stale if kept else 0,
                    **blocks)

    def clear_prefix_cache(self) -> None:
        """Forget every kept key and value and start a new weight version: samples decoding now, whose first keys
        are of the weights of the time, are not kept when they end (call it when the weights change; `paused`
        does)."""
        if self._cache is not None:
            self._cache.clear()

    @property
    def vocab_size(self) -> int:
        """The width of the model's logits (token ids a request may name lie below it)."""
        return self._vocab

    @property
    def context_length(self) -> int:
        """Prompt + new tokens a request may reach (the model's `max_position_embeddings`; unknown: no limit)."""
        return self._context if self._context is not None else 2**63 - 1

    # ------------------------------------------------------------------ any thread

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="serve-scheduler", daemon=True)
            self._thread.start()

    def close(self) -> None:
        """Stop the thread; every queued and running sample ends "cancelled"; the prefix cache is emptied."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join()
        else:
            self._end_everything("cancelled")
        self.clear_prefix_cache()  # its keys and values, on the device, go now

    def submit(self, prompt_ids: list[int], n: int, sampling: RequestSampling) -> Handle:
        """Queue a request of `n` samples of `prompt_ids`. Raises QueueFull, PromptTooLong, ValueError (bad input)."""
        prompt = [int(t) for t in prompt_ids]
        self._check(prompt, n, sampling)
        handle = Handle(self, n)
        stops = frozenset(() if sampling.ignore_eos else self.engine.eos_ids) | frozenset(
            int(t) for t in sampling.stop_token_ids)
        handle.stop_ids = stops  # the ids that end a sample: their text is not the answer's (chat.SampleText)
        request = Request(handle, prompt, sampling, stops, self.engine.device)
        with self._cond:
            if self._closed:
                raise RuntimeError("the scheduler is closed")
            if len(self._waiting) >= self.max_waiting:
                raise QueueFull(f"{len(self._waiting)} requests are waiting already (max_waiting={self.max_waiting})")
            self._waiting.append(request)
            self._submitted += 1
            self._cond.notify_all()
        return handle

    @contextlib.contextmanager
    def paused(self):
        """No decoding step runs inside and the decoding weights are let go (the model's weights may change):
        running samples resume after it on the weights then current; requests submitted meanwhile wait; the prefix
        cache is cleared (and what the running samples decoded is not kept when they end). Anything else that uses
        the engine or its model (`generate`, training passes) runs inside it."""
        with self._cond:
            self._pauses += 1
            self._cond.notify_all()
            while self._busy:
                self._cond.wait()
        self.clear_prefix_cache()  # nothing is kept meanwhile: the thread serves cancels only
        try:
            yield
        finally:
            with self._cond:
                self._pauses -= 1
                self._cond.notify_all()

    def _check(self, prompt: list[int], n: int, s: RequestSampling) -> None:
        if not prompt:
            raise ValueError("the prompt has no tokens")
        if any(not 0 <= t < self._vocab for t in prompt):
            raise ValueError(f"prompt token ids must lie in [0, {self._vocab})")
        if not 1 <= n <= self.max_running:
            raise ValueError(f"n={n}: must be 1 .. {self.max_running} (the server's max_running)")
        if s.max_tokens < 1:
            raise ValueError(f"max_tokens={s.max_tokens}: must be >= 1")
        if not s.temperature >= 0 or not 0 < s.top_p <= 1 or s.top_k < -1:
            raise ValueError(f"temperature={s.temperature}, top_p={s.top_p}, top_k={s.top_k}: need temperature >= 0, "
                             f"0 < top_p <= 1, top_k -1 (off) or >= 0")
        if len(prompt) + s.max_tokens > self.context_length:
            raise PromptTooLong(f"the prompt's {len(prompt)} tokens + max_tokens={s.max_tokens} exceed the model's "
                                f"context of {self.context_length} tokens")

    def _cancel(self, handle: Handle, sample: int | None) -> None:
        with self._cond:
            request = next((r for r in self._waiting if r.handle is handle), None)
            if request is None:  # running (or over): the thread ends it between steps
                self._cancels.append((handle, sample))
                self._cond.notify_all()
                return
            ended = sorted(request.live if sample is None else request.live & {sample})
            request.live.difference_update(ended)
            if not request.live:
                self._waiting.remove(request)
        handle._put([Event(s, None, None, "cancelled") for s in ended])

    # ------------------------------------------------------------------ the scheduler thread

    def _run(self) -> None:
        try:
            while True:
                with self._cond:
                    while not (self._closed or self._cancels or (not self._pauses and (self._waiting or self._rows))):
                        self._cond.wait()
                    if self._closed:
                        return
                    self._busy = not self._pauses and bool(self._waiting or self._rows)
                if not self._busy:  # paused: cancels are served all the same
                    self._take_cancels()
                    continue
                try:
                    self._serve()
                except Exception:  # entering the decoding weights failed: nothing can be served now
                    log.exception("serving failed; ending the running and waiting requests")
                    self._end_everything("error")
                finally:
                    with self._cond:
                        self._busy = False
                        self._cond.notify_all()
        finally:
            self._end_everything("cancelled")

    def _serve(self) -> None:
        """Decode on the decoding weights until a pause or close. They are held while idle too (a copy per burst of
        requests would cast every weight per burst); the model is in decoding mode (eval, the shared-prefix
        attention) only while rows decode."""
        engine = self.engine
        device = torch.device(engine.device)
        with inference_weights(engine.model, engine.dtype) as model, attention_backends(device):
            while True:
                with self._cond:
                    while not (self._closed or self._pauses or self._cancels or self._waiting or self._rows):
                        self._cond.wait()
                    if self._closed or self._pauses:
                        return
                with eval_mode(model), torch.no_grad(), autocast(device, engine.dtype), engine.decoding(model):
                    while not self._closed and not self._pauses and (self._rows or self._waiting):
                        self._tick(model)
                self._take_cancels()  # any that came when no row was decoding

    def _tick(self, model) -> None:
        """Cancelled rows leave, waiting requests join, one token per row, ended rows leave, one decoding step."""
        self._take_cancels()
        self._join(model, self._take_joining())
        if not self._rows:
            return
        try:
            if self._plan is None:
                self._plan = sampling_plan(self._rows, self._logits.device)
            token, logprob, tops = sample(self._logits, self._plan)
            logprob = logprob.tolist()
            keep = self._emit(token.tolist(), logprob, tops, raw_logprobs(self._rows, self._logits, token, logprob))
            if keep is not None:
                self._keep(keep)
                token = token[keep.to(token.device)]
            if self._rows:
                self._logits = self.engine.step(model, self._state, token)
        except Exception:
            log.exception("a decoding step failed; ending the %d samples in the batch", len(self._rows))
            self._end_rows("error")

    def _take_joining(self) -> list[Request]:
        """Waiting requests, in order, while their samples fit beside the running ones; none yet while a burst is
        still arriving (GATHER_QUIET_S says when)."""
        joining, room = [], self.max_running - len(self._rows)
        with self._cond:
            if not self._waiting or self._closed or self._pauses:
                return joining
            if self._rows:  # rows decode meanwhile: look again after the next step
                if self._submitted != self._seen and time.monotonic() - self._waiting[0].queued < GATHER_MAX_S:
                    self._seen = self._submitted
                    return joining
            else:  # nothing decodes: wait for the burst to pause
                while (self._submitted != self._seen and self._waiting and not self._closed and not self._pauses
                       and time.monotonic() - self._waiting[0].queued < GATHER_MAX_S):
                    self._seen = self._submitted
                    self._cond.wait(GATHER_QUIET_S)
                if self._closed or self._pauses or not self._waiting:
                    return joining
            self._seen = self._submitted
            while self._waiting and len(self._waiting[0].live) <= room:
                request = self._waiting.popleft()
                room -= len(request.live)
                joining.append(request)
        return joining

    def _join(self, model, requests: list[Request]) -> None:
        """`requests` into the batch: those resuming a kept prefix together, the others together."""
        requests = self._score(model, requests)
        if not requests:
            return
        self._counts["requests"] += len(requests)
        for r in requests:
            r.version = self._cache.version if self._cache is not None else 0
        self._counts["prompt_tokens"] += sum(len(r.prompt) for r in requests)
        if self._cache is None:
            self._join_together(model, requests, {})
            return
        matches = {}
        for r in requests:
            prompt = tuple(r.prompt)
            if prompt not in matches:
                matches[prompt] = self._cache.match(r.prompt)
            if matches[prompt] is not None:
                self._counts["prefix_cache_hits"] += 1
                self._counts["prefix_cache_tokens_reused"] += matches[prompt][1]
        try:
            self._join_together(model, [r for r in requests if matches[tuple(r.prompt)] is None], {})
            self._join_together(model, [r for r in requests if matches[tuple(r.prompt)] is not None], matches)
        finally:  # the matched block sequences were held for the join: the joined rows hold their own references
            for match in matches.values():
                if match is not None and hasattr(match[0], "release"):
                    match[0].release()

    def _score(self, model, requests: list[Request]) -> list[Request]:
        """`echo`: the prompt log-probs of each request asking, onto its handle before it joins (a failure ends that
        request); the requests that go on."""
        going = []
        for r in requests:
            if r.sampling.prompt_logprobs is not None:
                try:
                    r.handle.prompt_logprobs = processors.score_prompt(self.engine, model, r.prompt,
                                                                       r.sampling.prompt_logprobs)
                except Exception:
                    log.exception("scoring a prompt failed; its request ends with finish=error")
                    r.handle._put([Event(s, None, None, "error") for s in sorted(r.live)])
                    r.live.clear()
                    continue
            going.append(r)
        return going

    def _join_together(self, model, requests: list[Request], matches: dict) -> None:
        """Prefill `requests` into the batch together; if that fails, one by one, so that a failing prompt ends its
        own request only."""
        if not requests:
            return
        try:
            self._prefill(model, requests, matches)
        except Exception:
            if len(requests) > 1:
                for request in requests:
                    self._join_together(model, [request], matches)
                return
            log.exception("a prompt's prefill failed; its request ends with finish=error")
            request = requests[0]
            request.handle._put([Event(s, None, None, "error") for s in sorted(request.live)])
            request.live.clear()

    def _prefill(self, model, requests: list[Request], matches: dict) -> None:
        """Each distinct prompt prefilled once (with a match in `matches`: its tokens after the kept prefix only);
        its samples (of one request or several) in slots of the state's rows per slot: a new state's is the most
        samples of one prompt among the requests that open it, up to `SLOT_ROWS` (the module docstring says why)."""
        engine = self.engine
        by_prompt: dict[tuple[int, ...], list[Row]] = {}
        for r in requests:
            by_prompt.setdefault(tuple(r.prompt), []).extend(Row(r, s) for s in sorted(r.live))
        if matches:  # resumed: (T,) tokens after each kept prefix
            pasts = [matches[p][0] for p in by_prompt]
            ids, mask = [torch.tensor(p[matches[p][1]:]) for p in by_prompt], None
        else:
            width = max(len(p) for p in by_prompt)
            ids = torch.tensor([[engine.pad_id] * (width - len(p)) + list(p) for p in by_prompt])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in by_prompt])
            pasts = None
        group = self._state.group if self._state is not None else min(SLOT_ROWS, max(map(len, by_prompt.values())))
        slots = [rows[i:i + group] for rows in by_prompt.values() for i in range(0, len(rows), group)]
        copies = torch.tensor([-(-len(rows) // group) for rows in by_prompt.values()])
        counts = torch.tensor([len(slot) for slot in slots])
        rows = [row for slot in slots for row in slot]
        max_new = max(r.sampling.max_tokens for r in requests)
        if self._state is None:
            paged = dict(paged=True, pool=self._pool) if self.paged else {}
            self._logits, self._state = engine.start_slots(model, ids, mask, group, max_new, copies=copies,
                                                           rows=counts, pasts=pasts, **paged)
            self._pool = getattr(self._state, "pool", None)
            self._rows = rows
        else:
            logits = engine.add(model, self._state, ids, mask, torch.arange(len(rows)), max_new, copies=copies,
                                rows=counts, pasts=pasts)
            self._logits = torch.cat([self._logits, logits.to(self._logits.dtype)])
            self._rows = self._rows + rows
        self._plan = None

    def _emit(self, tokens: list[int], logprobs: list[float], tops: dict | None = None,
              raw: list[float | None] | None = None) -> torch.Tensor | None:
        """Each row's token to its consumer, and the final event of each sample that ended on it (its keys and
        values into the prefix cache, under the prompt and every sampled token but the last, never decoded, unless
        the weights changed since it joined); the rows that go on (None: all of them). The consumers are woken once
        all events are out."""
        kept, ended, wakes = [], False, _Wakes()
        try:
            for j, (row, t, lp) in enumerate(zip(self._rows, tokens, logprobs)):
                request, top, shown = row.request, tops.get(j) if tops else None, raw[j] if raw else None
                row.count += 1
                row.tokens.append(t)
                if t in request.stops:
                    finish = "stop"
                elif row.count >= request.sampling.max_tokens:
                    finish = "length"
                else:
                    request.handle._put([Event(row.sample, t, lp, top=top, raw_logprob=shown)], wakes)
                    kept.append(j)
                    continue
                ended = True
                request.live.discard(row.sample)
                if self._cache is not None:  # kept before its consumer learns of the end (and sends its next turn)
                    past = self._state.sequence(j) if self.paged else self._state.past(j)
                    self._cache.put(request.prompt + row.tokens[:-1], past, version=request.version)
                request.handle._put([Event(row.sample, t, lp, top=top, raw_logprob=shown),
                                     Event(row.sample, None, None, finish)], wakes)
        finally:
            wakes.run()
        return torch.tensor(kept, dtype=torch.long) if ended else None

    def _keep(self, keep: torch.Tensor) -> None:
        """Continue with rows `keep` (indices into the current rows) only."""
        if not len(keep):
            self._drop_state()
            return
        on = keep.to(self._logits.device)
        self._state.keep(on)
        self._logits = self._logits.index_select(0, on)
        rows = self._rows
        self._rows = [rows[j] for j in keep.tolist()]
        self._plan = None

    def _take_cancels(self) -> None:
        with self._cond:
            cancels, self._cancels = self._cancels, []
        if not cancels:
            return
        gone = {(handle, sample) for handle, sample in cancels}
        kept = []
        for j, row in enumerate(self._rows):
            handle = row.request.handle
            if (handle, None) in gone or (handle, row.sample) in gone:
                row.request.live.discard(row.sample)
                handle._put([Event(row.sample, None, None, "cancelled")])
            else:
                kept.append(j)
        if len(kept) < len(self._rows):
            self._keep(torch.tensor(kept, dtype=torch.long))

    def _end_rows(self, finish: str) -> None:
        for row in self._rows:
            row.request.live.discard(row.sample)
            row.request.handle._put([Event(row.sample, None, None, finish)])
        self._drop_state()

    def _drop_state(self) -> None:
        """No row decodes: the state goes (a paged one's blocks back to the pool)."""
        if self._state is not None and hasattr(self._state, "release"):
            try:
                self._state.release()
            except Exception:  # a state a failed step left inconsistent: its blocks stay used, serving goes on
                log.exception("releasing the decoding state's key/value blocks failed")
        self._state, self._logits, self._rows, self._plan = None, None, [], None

    def _end_everything(self, finish: str) -> None:
        """Every running and waiting sample ends with `finish`."""
        self._end_rows(finish)
        with self._cond:
            waiting, self._waiting = list(self._waiting), collections.deque()
            self._cancels = []
        for request in waiting:
            request.handle._put([Event(s, None, None, finish) for s in sorted(request.live)])
            request.live.clear()
