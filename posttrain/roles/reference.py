"""The reference policy: a frozen copy of the starting weights, used only when a KL term is on."""

from __future__ import annotations

import copy

import torch

from .common import batch_logprobs


class Reference:
    """``ref.fsdp_config.param_offload=True`` keeps the weights in CPU memory between uses, which frees accelerator
    memory for rollout and the update at the cost of one copy in and out per step (nothing to do on a CPU run)."""

    def __init__(self, policy_model, cfg, *, device, dtype, temperature: float):
        self.model = copy.deepcopy(policy_model).eval().requires_grad_(False)
        self.cfg, self.device, self.dtype, self.temperature = cfg, device, dtype, temperature
        self.offload = bool(cfg.fsdp_config.param_offload) and torch.device(device).type != "cpu"
        if self.offload:
            self.model.to("cpu")

    def compute_log_prob(self, batch):
        if self.offload:
            self.model.to(self.device)
        try:
            logp, _ = batch_logprobs(self.model, batch, micro_batch_size=self.cfg.log_prob_micro_batch_size_per_gpu,
                                     max_tokens=self.cfg.log_prob_max_token_len_per_gpu
                                     if self.cfg.log_prob_use_dynamic_bsz else None,
                                     device=self.device, dtype=self.dtype, temperature=self.temperature)
        finally:
            if self.offload:
                self.model.to("cpu")
        return logp
