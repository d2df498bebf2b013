"""The actor: owns the policy model and its optimizer; log-probs and the PPO-style update."""

from __future__ import annotations

from collections import defaultdict

import torch

from ..algo import agg_loss, agg_norm, get_policy_loss, kl_penalty
from ..data.batch import Batch
from .common import batch_logprobs, forward_logprobs, make_optimizer, micro_batches


class Actor:
    def __init__(self, model, cfg, *, device, dtype, temperature: float, n: int, max_response_length: int,
                 total_steps: int, seed: int = 0):
        self.model, self.cfg, self.device, self.dtype = model, cfg, device, dtype
        self.temperature, self.n = temperature, n
        self.norm_const = cfg.loss_scale_factor or max_response_length
        self.optimizer, self.scheduler = make_optimizer(model, cfg.optim, total_steps)
        self.policy_loss = get_policy_loss(cfg.policy_loss.loss_mode)
        self.generator = torch.Generator().manual_seed(seed)
        self.skipped_steps = 0

    def counters(self) -> dict:
        """State beside weights and optimizer that a resume must restore for the run to continue exactly."""
        return {"generator": self.generator.get_state(), "skipped_steps": self.skipped_steps}

    def load_counters(self, state: dict) -> None:
        self.generator.set_state(state["generator"])
        self.skipped_steps = int(state["skipped_steps"])

    def compute_log_prob(self, batch: Batch, micro_batch_size=None, max_tokens=None, with_entropy=False):
        return batch_logprobs(self.model, batch, micro_batch_size=micro_batch_size or self.cfg.ppo_micro_batch_size_per_gpu,
                              max_tokens=max_tokens, device=self.device, dtype=self.dtype,
                              temperature=self.temperature, with_entropy=with_entropy)

    def update(self, batch: Batch) -> dict[str, float]:
        """ppo_epochs x mini-batches (one optimizer step each) x micro-batches (gradient accumulation)."""
        cfg = self.cfg
        sums: dict[str, list[float]] = defaultdict(list)
        self.model.train()
        for _ in range(cfg.ppo_epochs):
            order = torch.randperm(len(batch), generator=self.generator) if cfg.shuffle else torch.arange(len(batch))
            mini_size = min(cfg.ppo_mini_batch_size * self.n, len(batch))
            for start in range(0, len(batch), mini_size):
                mini = batch.select(order[start:start + mini_size])
                self._step(mini, sums)
        out = {k: sum(v) / len(v) for k, v in sums.items() if v}
        out["actor/lr"] = self.scheduler.get_last_lr()[0]
        self.scheduler.step()
        return out

    def _step(self, mini: Batch, sums) -> None:
        cfg = self.cfg
        norm = agg_norm(mini["response_mask"].float(), self.norm_const)
        max_tokens = cfg.ppo_max_token_len_per_gpu if cfg.use_dynamic_bsz else None
        eps_low = cfg.clip_ratio_low if cfg.clip_ratio_low is not None else cfg.clip_ratio
        eps_high = cfg.clip_ratio_high if cfg.clip_ratio_high is not None else cfg.clip_ratio
        need_entropy = cfg.entropy_coeff != 0
        totals = defaultdict(float)
        if norm.tokens == 0:  # nothing to learn from; the loss is 0 by construction, say so
            sums["actor/empty_mini_batches"].append(1.0)
        self.optimizer.zero_grad(set_to_none=True)
        for mb in micro_batches(mini, cfg.ppo_micro_batch_size_per_gpu, max_tokens=max_tokens):
            mask = mb["response_mask"].float().to(self.device)
            logp, ent = forward_logprobs(self.model, mb, device=self.device, dtype=self.dtype,
                                         temperature=self.temperature, with_entropy=True)
            old = mb["old_log_probs"].to(self.device) if "old_log_probs" in mb else logp.detach()
            pg_loss, metrics = self.policy_loss(logp, old, mb["advantages"].to(self.device), mask,
                                                loss_agg_mode=cfg.loss_agg_mode, clip_ratio_low=eps_low,
                                                clip_ratio_high=eps_high, clip_ratio_c=cfg.clip_ratio_c,
                                                norm=norm, const=self.norm_const)
            loss = pg_loss
            entropy = agg_loss(ent.detach() if not need_entropy else ent, mask, cfg.loss_agg_mode, norm)
            if need_entropy:
                loss = loss - cfg.entropy_coeff * entropy
            if cfg.use_kl_loss:
                kl = agg_loss(kl_penalty(logp, mb["ref_log_probs"].to(self.device), cfg.kl_loss_type), mask,
                              cfg.loss_agg_mode, norm)
                loss = loss + cfg.kl_loss_coef * kl
                totals["actor/kl_loss"] += kl.item()
            loss.backward()
            share = float(mask.sum()) / max(norm.tokens, 1.0)  # token share: metrics averaged per token
            totals["actor/pg_loss"] += pg_loss.item()
            totals["actor/entropy"] += entropy.item()
            for k, v in metrics.items():
                totals[k] += float(v) * share
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.grad_clip)
        if torch.isfinite(grad_norm):
            self.optimizer.step()
        else:
            self.skipped_steps += 1
            self.optimizer.zero_grad(set_to_none=True)
        sums["actor/grad_norm"].append(float(grad_norm))
        sums["actor/skipped_steps"].append(float(self.skipped_steps))
        for k, v in totals.items():
            sums[k].append(v)
