"""The reference policy, used only when a KL term is on: a frozen model loaded from the starting weights, or — with
LoRA — the actor's own model with its adapter switched off (no second copy of the weights)."""

from __future__ import annotations

import contextlib

import torch

from ..data.batch import Batch
from ..models.load import eval_mode
from .common import ModelRunner


class Reference:
    """``ref.fsdp_config.param_offload=True`` keeps the weights in CPU memory between uses: with FSDP2 through its
    CPU offload policy; in one plain process on a GPU by moving the model in and out per step."""

    def __init__(self, runner: ModelRunner, cfg, *, temperature: float, adapter_off: bool = False):
        self.runner, self.model, self.cfg, self.temperature = runner, runner.model, cfg, temperature
        self.adapter_off = adapter_off
        if not adapter_off:
            self.model.eval().requires_grad_(False)
        self.swap_to_cpu = (bool(cfg.fsdp_config.param_offload) and not runner.sharded and not adapter_off
                            and runner.device.type != "cpu")
        if self.swap_to_cpu:
            self.model.to("cpu")

    @contextlib.contextmanager
    def _weights(self):
        if self.adapter_off:  # the actor's model with the LoRA adapter disabled = the starting weights
            with self.model.lm.disable_adapter():
                yield
            return
        if self.swap_to_cpu:
            self.model.to(self.runner.device)
        try:
            yield
        finally:
            if self.swap_to_cpu:
                self.model.to("cpu")

    @torch.no_grad()
    def compute_log_prob(self, batch: Batch) -> torch.Tensor:
        def compute(mb):
            logp, _ = self.runner.logprobs(mb, temperature=self.temperature, with_entropy=False)
            return (logp,)

        cfg = self.cfg
        with self._weights(), eval_mode(self.model):
            (logp,) = self.runner.per_row(batch, compute, micro_batch_size=cfg.log_prob_micro_batch_size_per_gpu,
                                          max_tokens=cfg.log_prob_max_token_len_per_gpu
                                          if cfg.log_prob_use_dynamic_bsz else None)
        return logp
