"""The critic: a value model (HF backbone + scalar head) predicting V for the state before each response token,
trained with the clipped value loss; only built when the estimator needs values (`gae`) or `critic.enable=True`."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import torch
from torch import nn

from ..algo import agg_norm, value_loss
from ..data.batch import Batch
from ..models.load import autocast
from .common import eval_mode, make_optimizer, micro_batches, trimmed


class ValueModel(nn.Module):
    """Decoder backbone of a causal LM plus a linear head to one value per position."""

    def __init__(self, backbone: nn.Module, hidden_size: int):
        super().__init__()
        self.backbone = backbone
        self.value_head = nn.Linear(hidden_size, 1)
        nn.init.normal_(self.value_head.weight, std=1.0 / (hidden_size + 1))
        nn.init.zeros_(self.value_head.bias)

    @classmethod
    def from_pretrained(cls, path: str, *, device, trust_remote_code=False, override_config=None,
                        gradient_checkpointing=False) -> "ValueModel":
        from transformers import AutoConfig, AutoModel

        config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
        for key, value in (override_config or {}).items():
            setattr(config, key, value)
        backbone = AutoModel.from_pretrained(path, config=config, dtype=torch.float32, trust_remote_code=trust_remote_code)
        if gradient_checkpointing:
            from ..models.load import enable_checkpointing

            enable_checkpointing(backbone)
        model = cls(backbone, config.hidden_size).to(device)
        head = Path(path) / "value_head.safetensors"
        if head.is_file():  # a critic checkpoint: restore its head too
            from safetensors.torch import load_file

            model.value_head.load_state_dict(load_file(str(head)))
        return model

    def forward(self, input_ids, attention_mask) -> torch.Tensor:
        position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
        hidden = self.backbone(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                               use_cache=False).last_hidden_state
        return self.value_head(hidden).squeeze(-1)

    def load_weights(self, path) -> None:
        """Restore backbone and head saved by `save_pretrained` (used on resume)."""
        from safetensors.torch import load_file

        from ..trainer.checkpoint import load_safetensors_dir

        self.backbone.load_state_dict(load_safetensors_dir(Path(path), exclude="value_head.safetensors"))
        self.value_head.load_state_dict(load_file(str(Path(path) / "value_head.safetensors")))

    def save_pretrained(self, path, **kwargs) -> None:
        from safetensors.torch import save_file

        self.backbone.save_pretrained(path, **kwargs)
        save_file({k: v.contiguous() for k, v in self.value_head.state_dict().items()},
                  str(Path(path) / "value_head.safetensors"))


class Critic:
    def __init__(self, model: ValueModel, cfg, actor_cfg, *, device, dtype, n: int, max_response_length: int,
                 total_steps: int, seed: int = 0):
        self.model, self.device, self.dtype, self.n = model, device, dtype, n
        self.cfg = cfg
        self.mini = cfg.ppo_mini_batch_size or actor_cfg.ppo_mini_batch_size
        self.micro = cfg.ppo_micro_batch_size_per_gpu or actor_cfg.ppo_micro_batch_size_per_gpu
        self.epochs = cfg.ppo_epochs or actor_cfg.ppo_epochs
        self.agg_mode = cfg.loss_agg_mode or actor_cfg.loss_agg_mode
        self.norm_const = actor_cfg.loss_scale_factor or max_response_length
        self.optimizer, self.scheduler = make_optimizer(model, cfg.optim, total_steps)
        self.generator = torch.Generator().manual_seed(seed + 1)

    def counters(self) -> dict:
        return {"generator": self.generator.get_state()}

    def load_counters(self, state: dict) -> None:
        self.generator.set_state(state["generator"])

    def _values(self, mb: Batch) -> torch.Tensor:
        ids, mask, resp_l, full_l = trimmed(mb)
        with autocast(self.device, self.dtype):
            values = self.model(ids.to(self.device), mask.to(self.device))[:, -(resp_l + 1):-1].float()
        values = torch.nn.functional.pad(values, (0, full_l - resp_l))
        return values * mb["response_mask"].to(self.device)

    @torch.no_grad()
    def compute_values(self, batch: Batch) -> torch.Tensor:
        with eval_mode(self.model):
            return torch.cat([self._values(mb).cpu()
                              for mb in micro_batches(batch, self.micro, max_tokens=self._max_tokens)])

    @property
    def _max_tokens(self):
        return self.cfg.ppo_max_token_len_per_gpu if self.cfg.use_dynamic_bsz else None

    def update(self, batch: Batch) -> dict[str, float]:
        sums: dict[str, list[float]] = defaultdict(list)
        self.model.train()
        for _ in range(self.epochs):
            order = torch.randperm(len(batch), generator=self.generator) if self.cfg.shuffle else torch.arange(len(batch))
            size = min(self.mini * self.n, len(batch))
            for start in range(0, len(batch), size):
                self._step(batch.select(order[start:start + size]), sums)
        out = {k: sum(v) / len(v) for k, v in sums.items()}
        out["critic/lr"] = self.scheduler.get_last_lr()[0]
        self.scheduler.step()
        return out

    def _step(self, mini: Batch, sums) -> None:
        norm = agg_norm(mini["response_mask"].float(), self.norm_const)
        self.optimizer.zero_grad(set_to_none=True)
        loss_total, clipfrac = 0.0, 0.0
        for mb in micro_batches(mini, self.micro, max_tokens=self._max_tokens):
            mask = mb["response_mask"].float().to(self.device)
            loss, metrics = value_loss(self._values(mb), mb["values"].to(self.device), mb["returns"].to(self.device),
                                       mask, cliprange_value=self.cfg.cliprange_value, loss_agg_mode=self.agg_mode,
                                       norm=norm, const=self.norm_const)
            loss.backward()
            loss_total += loss.item()
            clipfrac += float(metrics["critic/vf_clipfrac"]) * float(mask.sum()) / max(norm.tokens, 1.0)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip)
        if torch.isfinite(grad_norm):
            self.optimizer.step()
        sums["critic/vf_loss"].append(loss_total)
        sums["critic/vf_clipfrac"].append(clipfrac)
        sums["critic/grad_norm"].append(float(grad_norm))
