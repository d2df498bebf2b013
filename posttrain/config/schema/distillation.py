"""`distillation.*`: on-policy distillation, a frozen teacher scoring the student's own samples (docs/algorithms.md,
"On-policy distillation")."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional


@dataclass
class DistillationLossConfig:
    loss_mode: str = "k3"
    """per-token divergence: a reverse-KL estimator on the sampled token (`k1`/`kl`, `k3`/`low_var_kl`, `k2`/`mse`,
    `abs`), or `forward_kl_topk` (forward KL over the teacher's top-k tokens)"""
    topk: Optional[int] = 32
    """k of `forward_kl_topk`: how many of the teacher's most likely tokens each position keeps"""
    use_task_rewards: bool = True
    """True: the task's policy loss plus `distillation_loss_coef` x the distillation loss; False: the distillation
    loss alone"""
    distillation_loss_coef: float = 1.0
    """weight of the distillation loss beside the task's (with `use_task_rewards` only)"""
    loss_max_clamp: Optional[float] = None
    """clamp each token's divergence to [-c, c] (null = no clamp)"""
    log_prob_min_clamp: Optional[float] = None
    """`forward_kl_topk`: floor of both models' log-probs inside the divergence (null = none)"""
    use_policy_gradient: bool = False
    """False (GKD): backpropagate the divergence; True: `-divergence` is each token's advantage in the PPO clipped
    loss (k1 needs True: its direct gradient does not depend on the teacher)"""
    policy_loss_mode: str = "vanilla"
    """the policy loss of `use_policy_gradient`: `vanilla` (PPO clip) only"""
    clip_ratio: float = 0.2
    """the PPO clip of `use_policy_gradient`; `clip_ratio_low` / `clip_ratio_high` are the ones applied"""
    clip_ratio_low: float = 0.2
    """the PPO clip of `use_policy_gradient`: lower side"""
    clip_ratio_high: float = 0.2
    """the PPO clip of `use_policy_gradient`: upper side"""
    use_chunked_topk: bool = False
    """accepted for portability: the student's log-probs on the teacher's top-k are always computed in chunks"""
    chunked_topk_chunk_size: int = 4096
    """accepted for portability: top-k log-probs are computed 1024 positions at a time, like every log-prob"""


@dataclass
class DistillationConfig:
    enabled: bool = False
    """load the teacher(s) and add the distillation loss to the actor's"""
    teacher_models: dict = field(default_factory=dict)
    """teachers by name: each `{model_path, key}` (`model_path` required; `num_replicas`, `inference.*` accepted,
    without effect); one entry is the teacher of every row, several are routed by `teacher_key`. A teacher is frozen,
    placed like the reference (`actor_rollout_ref.ref.fsdp_config`: sharded over the training processes), computes
    in the rollout's dtype at temperature 1, and must share the student's vocabulary"""
    teacher_key: str = "data_source"
    """with several teachers: the row field whose value names the teacher (its `key`)"""
    n_gpus_per_node: int = 8
    """accepted for portability: the teachers run in the training processes (no separate pool)"""
    nnodes: int = 0
    """accepted for portability: the teachers run in the training processes (no separate pool)"""
    distillation_loss: DistillationLossConfig = field(default_factory=DistillationLossConfig)
