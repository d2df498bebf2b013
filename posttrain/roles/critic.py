"""The critic: a value model (models.policy.ValueModel) predicting V for the state before each response token,
trained with the clipped value loss; only built when the estimator needs values (`gae`) or `critic.enable=True`.
Mini-batches and data-parallel splitting work as in the actor."""

from __future__ import annotations

from collections import defaultdict

import torch

from ..algo import agg_norm, value_loss
from ..data.batch import Batch
from ..parallel import set_gradient_sync
from ..models.load import eval_mode
from .common import ModelRunner, group_rows, images_of, make_optimizer, shared_prompts, trimmed
from .nonfinite import NonFiniteGuard


class Critic:
    def __init__(self, runner: ModelRunner, cfg, actor_cfg, *, max_response_length: int, total_steps: int,
                 seed: int = 0, offload_optimizer: bool = False, max_nonfinite_in_a_row: int = 5):
        self.runner, self.model, self.cfg = runner, runner.model, cfg
        self.mini = cfg.ppo_mini_batch_size or actor_cfg.ppo_mini_batch_size
        self.micro = cfg.ppo_micro_batch_size_per_gpu or actor_cfg.ppo_micro_batch_size_per_gpu
        self.epochs = cfg.ppo_epochs or actor_cfg.ppo_epochs
        self.agg_mode = cfg.loss_agg_mode or actor_cfg.loss_agg_mode
        self.norm_const = actor_cfg.loss_scale_factor or max_response_length
        self.optimizer, self.scheduler = make_optimizer(self.model, cfg.optim, total_steps)
        self.generator = torch.Generator().manual_seed(seed + 1)
        self.offload_optimizer = offload_optimizer
        self.nonfinite = NonFiniteGuard("critic", max_nonfinite_in_a_row)

    def counters(self) -> dict:
        return {"generator": self.generator.get_state(), "scheduler": self.scheduler.state_dict()}

    def load_counters(self, state: dict) -> None:
        self.generator.set_state(state["generator"])
        if "scheduler" in state:
            self.scheduler.load_state_dict(state["scheduler"])

    @property
    def _max_tokens(self):
        return self.cfg.ppo_max_token_len_per_gpu if self.cfg.use_dynamic_bsz else None

    def _values(self, mb: Batch) -> torch.Tensor:
        ids, mask, resp_l, full_l = trimmed(mb)
        device = self.runner.device
        with self.runner.autocast():
            values = self.model(ids.to(device), mask.to(device), resp_l, prompts=shared_prompts(mb),
                                images=images_of(mb), packed=self.runner.packs()).float()
        values = torch.nn.functional.pad(values, (0, full_l - resp_l))
        return values * mb["response_mask"].to(device)

    @torch.no_grad()
    def compute_values(self, batch: Batch) -> torch.Tensor:
        with eval_mode(self.model):
            (values,) = self.runner.per_row(batch, lambda mb: (self._values(mb),), micro_batch_size=self.micro,
                                            max_tokens=self._max_tokens)
        return values

    def update(self, batch: Batch) -> dict[str, float]:
        sums: dict[str, list[float]] = defaultdict(list)
        self.model.train()
        groups = group_rows(batch.meta["uid"])
        for _ in range(self.epochs):
            order = (torch.randperm(len(groups), generator=self.generator).tolist() if self.cfg.shuffle
                     else list(range(len(groups))))
            for start in range(0, len(groups), self.mini):
                self._step(batch.select([r for g in order[start:start + self.mini] for r in groups[g]]), sums)
        out = {k: sum(v) / len(v) for k, v in sums.items()}
        out["critic/lr"] = self.scheduler.get_last_lr()[0]
        self.scheduler.step()
        return out

    def _step(self, mini: Batch, sums) -> None:
        runner = self.runner
        norm = agg_norm(mini["response_mask"].float(), self.norm_const)
        mine = mini.select(runner.my_rows(mini))
        micros = runner.micro_batches(mine, self.micro, max_tokens=self._max_tokens)
        self.optimizer.zero_grad(set_to_none=True)
        totals = defaultdict(float)
        loss_not_finite = False
        with runner.casts_kept():  # each weight cast once for all the micro-batches
            for i, mb in enumerate(micros):
                set_gradient_sync(self.model, i == len(micros) - 1)
                mask = mb["response_mask"].float().to(runner.device)
                old, returns, values = mb["values"].to(runner.device), mb["returns"].to(runner.device), self._values(mb)
                loss, metrics = value_loss(values, old, returns, mask, cliprange_value=self.cfg.cliprange_value,
                                           loss_agg_mode=self.agg_mode, norm=norm, const=self.norm_const)
                loss_not_finite |= self.nonfinite.loss_not_finite(
                    loss, [("returns", returns), ("old values", old), ("values", values), ("vf_loss", loss)], mask)
                runner.backward(loss)
                totals["critic/vf_loss"] += loss.item()
                share = float(mask.sum()) / max(norm.tokens, 1.0)
                totals["critic/vf_clipfrac"] += float(metrics["critic/vf_clipfrac"]) * share
        grad_norm, stepped = runner.clip_and_step(self.optimizer, self.cfg.grad_clip, self.offload_optimizer,
                                                  loss_not_finite=loss_not_finite)
        self.nonfinite.after_update(stepped, grad_norm)
        for k, v in runner.sum_metrics(totals).items():
            sums[k].append(v)
        sums["critic/grad_norm"].append(grad_norm)
