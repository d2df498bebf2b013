"""One decoding step replayed as a CUDA graph.

On a GPU a decoding step of a small or mid-sized model is a few hundred kernels of microseconds each, and
launching them from Python (the model's modules, the shared-prefix attention) takes longer than running them: the
GPU waits for the CPU. A CUDA graph records the step's kernels once and replays them with one launch.

A graph replays the memory addresses it was recorded with, so the step's inputs live in fixed tensors that each
step copies into (token, position), and the decoding state runs in its static mode (`DecodeState(static=True)`:
buffers reserved before the step, the write position and the mask updated in place). A new graph is recorded when
the state's capacity doubles or its rows change (finished rows dropped, rows added: `DecodeState.layout`), so a
call records a handful. Sampling stays eager: it is a few kernels per step, and the generator's state must advance
as it does without graphs.
"""

from __future__ import annotations

import torch

from .decode_state import DecodeState

WARMUP_RUNS = 1  # eager runs on a side stream before recording (lazy initialisation inside cuBLAS and the caching allocator)


class DecodeStep:
    """`step(token, position, cache)` -> logits (rows, V) of the next position; with `graphs`, the forward is
    recorded per (rows, capacity, layout) and replayed; without, it runs eagerly on the same static inputs (the
    CPU path of the tests). With graphs the logits are the graph's output tensor: valid until the next call."""

    def __init__(self, forward, *, graphs: bool):
        self.forward, self.graphs = forward, graphs
        self.key: tuple | None = None
        self.graph: torch.cuda.CUDAGraph | None = None
        self.recorded = 0  # graphs recorded by this step (reported in the tests and the benchmark)

    def _run(self, cache: DecodeState) -> torch.Tensor:
        out = self.forward(input_ids=self.token[:, None], position_ids=self.position[:, None], cache=cache,
                           use_cache=True, shared_prefix=cache)
        return out.logits[:, -1]

    def __call__(self, token: torch.Tensor, position: torch.Tensor, cache: DecodeState) -> torch.Tensor:
        key = (len(token), cache.capacity, cache.layout)  # a new layout: new tensors the step must read
        if key != self.key:
            self.key, self.graph = key, None
            self.token, self.position = token.clone(), position.clone()
            cache.reserve()
            if self.graphs:
                return self._record(cache)
        self.token.copy_(token)
        self.position.copy_(position)
        if self.graph is None:
            return self._run(cache)
        self.graph.replay()
        return self.logits

    def _record(self, cache: DecodeState) -> torch.Tensor:
        """Record the step on the inputs already in place and replay it once (this step's logits). The warm-up
        runs compute this very step, so the keys and values they write are the ones the replay writes again."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(WARMUP_RUNS):
                self._run(cache)
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):  # its own memory pool, freed with the graph
            self.logits = self._run(cache)
        self.recorded += 1
        self.graph.replay()
        return self.logits
