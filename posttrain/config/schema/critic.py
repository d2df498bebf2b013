"""`critic.*`: the value model of the estimators that need one (gae)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from .actor_rollout_ref import FSDPConfig, OptimConfig


@dataclass
class CriticModelConfig:
    path: Optional[str] = None
    """value-model backbone (directory or hub id); null = the actor's path"""
    tokenizer_path: Optional[str] = None
    """must be the actor's tokenizer (the critic reads the actor's token ids); another one is rejected"""
    trust_remote_code: bool = False
    """as the actor's"""
    use_remove_padding: bool = True
    """as the actor's"""
    enable_gradient_checkpointing: bool = True
    """as the actor's"""
    override_config: dict = field(default_factory=dict)
    """as the actor's"""
    fsdp_config: FSDPConfig = field(default_factory=FSDPConfig)
    """*: as the actor's"""


@dataclass
class CriticConfig:
    enable: Optional[bool] = None
    """null = on exactly when the estimator needs a critic"""
    strategy: str = "fsdp"
    """as the actor's"""
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-5))
    """*: as the actor's optimizer keys"""
    model: CriticModelConfig = field(default_factory=CriticModelConfig)
    ppo_mini_batch_size: Optional[int] = None
    """null = the actor's"""
    ppo_micro_batch_size_per_gpu: Optional[int] = None
    """null = the actor's"""
    use_dynamic_bsz: bool = False
    """token-budget micro-batches"""
    ppo_max_token_len_per_gpu: int = 32768
    """token-budget micro-batches"""
    ulysses_sequence_parallel_size: Optional[int] = None
    """null = the actor's; any other value must equal it (one layout for every role)"""
    ppo_epochs: Optional[int] = None
    """null = the actor's"""
    shuffle: bool = False
    """as the actor's"""
    grad_clip: float = 1.0
    """as the actor's"""
    cliprange_value: float = 0.5
    """value clip around the old values"""
    loss_agg_mode: Optional[str] = None
    """null = the actor's"""
