"""The reference policy: a frozen copy of the starting weights, used only when a KL term is on."""

from __future__ import annotations

import copy

from .common import batch_logprobs


class Reference:
    def __init__(self, policy_model, cfg, *, device, dtype, temperature: float):
        self.model = copy.deepcopy(policy_model).eval().requires_grad_(False)
        self.cfg, self.device, self.dtype, self.temperature = cfg, device, dtype, temperature

    def compute_log_prob(self, batch):
        logp, _ = batch_logprobs(self.model, batch, micro_batch_size=self.cfg.log_prob_micro_batch_size_per_gpu,
                                 max_tokens=self.cfg.log_prob_max_token_len_per_gpu if self.cfg.log_prob_use_dynamic_bsz else None,
                                 device=self.device, dtype=self.dtype, temperature=self.temperature)
        return logp
