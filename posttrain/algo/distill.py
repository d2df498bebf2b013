"""On-policy distillation (`distillation.*`): a frozen teacher scores the student's own samples, token by token.

Two families of per-token divergence `D_t` (docs/algorithms.md, "On-policy distillation"):

- single-sample reverse-KL estimators on the sampled token (`loss_mode` = `k1`/`kl`, `k3`/`low_var_kl`, `k2`/`mse`,
  `abs`): `kl_penalty(logp_student, logp_teacher, mode)`, the same estimators as the reference KL;
- `forward_kl_topk`: `sum_{v in TopK_teacher} p_T(v) (log p_T(v) - log p_S(v))`, with the student's log-probs
  taken from its full-vocabulary softmax (not renormalised over the k tokens; neither is the teacher's), so the
  value can dip below 0 and is clamped at 0.

`D_t` becomes a loss one of two ways: backpropagated directly (`use_policy_gradient=False`, GKD), or as the reward
`-sg(D_t)` of each token, used as that token's advantage in the vanilla PPO clipped loss (`use_policy_gradient=True`).
The task's policy loss is added when `use_task_rewards` (then `distillation_loss_coef` weighs the distillation term).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from .aggregation import AggNorm, agg_loss
from .kl import KL_ESTIMATORS, kl_penalty
from .losses import LossSettings, vanilla
from .stats import masked_mean

TOPK_MODE = "forward_kl_topk"
NO_TEACHER_GRADIENT = ("k1", "kl")  # d/dtheta (logp - logp_T) = d logp: the teacher drops out of the gradient


@dataclass(frozen=True)
class DistillSettings:
    """`distillation.distillation_loss.*` (verl's keys; defaults are verl's YAML defaults)."""

    loss_mode: str = "k3"
    topk: int | None = 32
    use_task_rewards: bool = True
    distillation_loss_coef: float = 1.0
    loss_max_clamp: float | None = None
    log_prob_min_clamp: float | None = None
    use_policy_gradient: bool = False
    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2

    @property
    def uses_topk(self) -> bool:
        return self.loss_mode == TOPK_MODE

    def check(self) -> "DistillSettings":
        """Refuse what has no meaning; returns self."""
        if self.loss_mode != TOPK_MODE and self.loss_mode not in KL_ESTIMATORS:
            raise ValueError(f"distillation.distillation_loss.loss_mode '{self.loss_mode}': choose {TOPK_MODE} or a "
                             f"KL estimator {KL_ESTIMATORS.names()}")
        if self.loss_mode in NO_TEACHER_GRADIENT and not self.use_policy_gradient:
            raise ValueError(f"distillation.distillation_loss.loss_mode={self.loss_mode} needs use_policy_gradient="
                             "True: backpropagated directly, the gradient of logp - logp_teacher does not depend on "
                             "the teacher")
        if self.uses_topk and (self.topk is None or self.topk < 1):
            raise ValueError(f"distillation.distillation_loss.topk must be >= 1 for {TOPK_MODE}, got {self.topk}")
        if self.uses_topk and self.use_policy_gradient:
            warnings.warn(f"{TOPK_MODE} with use_policy_gradient=True moves only the sampled token's log-prob: the "
                          "teacher's top-k distribution is mostly unused (use_policy_gradient=False is GKD)",
                          stacklevel=2)
        if self.loss_max_clamp is not None and self.loss_max_clamp <= 0:
            raise ValueError("distillation.distillation_loss.loss_max_clamp must be > 0 or null")
        return self


def reverse_kl_estimate(student_logp: Tensor, teacher_logp: Tensor, mode: str) -> Tensor:
    """(B, L) single-sample estimate of KL(student || teacher) at the sampled tokens (d = logp_S - logp_T)."""
    return kl_penalty(student_logp, teacher_logp, mode)


def forward_kl_topk(student_topk_logp: Tensor, teacher_topk_logp: Tensor,
                    log_prob_min_clamp: float | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """(..., K) log-probs of the teacher's top-k tokens under each model (full-vocabulary softmax) ->
    (forward KL over those k tokens clamped at 0, the student's mass on them, the teacher's mass), each (...)."""
    dtype = torch.promote_types(student_topk_logp.dtype, torch.float32)  # bf16 in: float32 math
    s, t = student_topk_logp.to(dtype), teacher_topk_logp.to(dtype)
    student_mass, teacher_mass = s.exp().sum(-1), t.exp().sum(-1)
    if log_prob_min_clamp is not None:
        s, t = s.clamp_min(log_prob_min_clamp), t.clamp_min(log_prob_min_clamp)
    kl = (t.exp() * (t - s)).sum(-1)
    return kl.clamp_min(0.0), student_mass, teacher_mass


def distillation_term(per_token: Tensor, log_prob: Tensor, old_log_prob: Tensor, mask: Tensor, *,
                      settings: DistillSettings, loss_settings: LossSettings, norm: AggNorm | None = None,
                      rollout_is_weights: Tensor | None = None) -> tuple[Tensor, dict]:
    """The distillation loss of one micro-batch from its (B, L) divergences `per_token` (clamped to
    +-loss_max_clamp): aggregated like the policy loss (`loss_agg_mode`, the mini-batch normaliser `norm`), or with
    `use_policy_gradient` the vanilla PPO loss with advantages `-sg(per_token)` and the distillation clip range
    (rollout-correction weights apply there only, as in verl)."""
    s = settings
    metrics = {"actor/distillation/abs_loss": masked_mean(per_token.detach().abs(), mask)}
    if s.loss_max_clamp is not None:
        per_token = per_token.clamp(-s.loss_max_clamp, s.loss_max_clamp)
    if s.use_policy_gradient:
        pg = replace(loss_settings, clip_ratio_low=s.clip_ratio_low, clip_ratio_high=s.clip_ratio_high)
        loss, pg_metrics = vanilla(log_prob, old_log_prob, -per_token.detach(), mask, settings=pg, norm=norm,
                                   rollout_is_weights=rollout_is_weights)
        metrics |= {f"actor/distillation/{k.removeprefix('actor/')}": v for k, v in pg_metrics.items()}
    else:
        loss = agg_loss(per_token, mask, loss_settings.loss_agg_mode, norm, loss_settings.const)
    metrics["actor/distillation/loss"] = loss.detach()
    return loss, metrics


def combine(task_loss: Tensor, distill_loss: Tensor, settings: DistillSettings) -> Tensor:
    """`task + coef * distill` with `use_task_rewards`, else the distillation loss alone (coefficient 1)."""
    if not settings.use_task_rewards:
        return distill_loss
    return task_loss + settings.distillation_loss_coef * distill_loss
