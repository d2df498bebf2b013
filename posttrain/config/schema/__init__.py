"""The config key tree users already type, as typed dataclasses with the customary defaults.

One module per top-level section. Each field's documentation is the string literal under it (config/fielddocs.py
reads them; docs/config.md is generated from them); the few fields kept only so scripts port say so there. Keys of
the familiar tree that are not fields here are decided in config/keytable.py: read as one of these keys, accepted
with a note, or refused with the reason.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .actor_rollout_ref import ActorRolloutRefConfig
from .algorithm import AlgorithmConfig
from .async_training import AsyncTrainingConfig, RolloutGroupConfig
from .critic import CriticConfig
from .data import DataConfig
from .distillation import DistillationConfig
from .reward import CustomRewardFunctionConfig, RewardModelConfig
from .trainer import TrainerConfig


@dataclass
class Config:
    data: DataConfig = field(default_factory=DataConfig)
    actor_rollout_ref: ActorRolloutRefConfig = field(default_factory=ActorRolloutRefConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    reward_model: RewardModelConfig = field(default_factory=RewardModelConfig)
    custom_reward_function: CustomRewardFunctionConfig = field(default_factory=CustomRewardFunctionConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    distillation: DistillationConfig = field(default_factory=DistillationConfig)
    rollout: RolloutGroupConfig = field(default_factory=RolloutGroupConfig)
    async_training: AsyncTrainingConfig = field(default_factory=AsyncTrainingConfig)

