"""R3 router replay's record (models/router_replay.py): the experts every token the decoding engine computes was
routed to, as the engine computed it — the prompts in their prefill calls, each sampled token in the decoding step
that feeds it back — per sampled row and position. The last sampled token of a row is never fed back, so it has
no record (the training forward routes it itself; its hidden state predicts nothing that is trained)."""

from __future__ import annotations

import contextlib

import torch
from torch import Tensor

from ..models.router_replay import UNKNOWN, RoutingSession
from .prefill import prefill_buckets


class EngineRouting:
    """One `_decode` call's routing: `prefill()` around the prompts' prefill, `decoding()` around the decoding loop
    with `step(ids)` before each step, then `table()`: (prompts * n, width, layers, k), UNKNOWN where no forward
    computed a position."""

    def __init__(self, model, prompt_mask: Tensor, n: int, max_new: int, call_cost: int | None = None):
        self.model, self.mask, self.n = model, prompt_mask, n
        self.width = prompt_mask.shape[1] + max_new
        self.buckets = prefill_buckets(prompt_mask.sum(-1).cpu(), call_cost)  # the prefill's calls, in its order
        self._prompts: Tensor | None = None
        self._samples: RoutingSession | None = None

    @contextlib.contextmanager
    def prefill(self):
        with RoutingSession(self.model, record_width=self.width, rows=len(self.mask)) as session:
            session.calls.extend(self.buckets if len(self.buckets) > 1 else [])
            yield
        self._prompts = session.table

    @contextlib.contextmanager
    def decoding(self):
        with RoutingSession(self.model, record_width=self.width, rows=len(self.mask) * self.n) as session:
            self._samples = session
            yield

    def step(self, ids: Tensor) -> None:
        """The next model call decodes the rows `ids` (the state's sequence ids, in the call's row order)."""
        self._samples.calls.append(ids.cpu())

    def table(self) -> Tensor:
        prompts = self._prompts.repeat_interleave(self.n, dim=0)
        if self._samples is None:
            return prompts
        samples = self._samples.table
        return torch.where(samples == UNKNOWN, prompts, samples)


def generate_recording_routing(engine, batch, sampling):
    """`engine.generate(batch, sampling)` with each row's routing record in `meta["routed_experts"]`: (positions,
    layers, k) int16 over the row's real tokens, UNKNOWN where the engine computed none (R3)."""
    if not hasattr(engine, "record_routing"):
        raise RuntimeError(f"router replay R3: the {type(engine).__name__} does not record the experts it routes to "
                           "(posttrain's decoding engine does)")
    engine.routing_tables, engine.record_routing = [], True
    try:
        out = engine.generate(batch, sampling)
    finally:
        engine.record_routing = False
    tables, engine.routing_tables = engine.routing_tables, []
    rows = [row for table in tables for row in table]
    lengths = out["attention_mask"].sum(-1).tolist()
    if len(rows) != len(lengths):
        raise RuntimeError(f"router replay R3: the engine recorded {len(rows)} rows for {len(lengths)} responses")
    out.meta["routed_experts"] = [row[:n].to(torch.int16).clone() for row, n in zip(rows, lengths)]
    return out
