"""Pure tensor functions of RL post-training: advantage estimators, policy/value losses, KL, aggregation.

Only torch is imported here. Everything is looked up by name in registries that users extend with decorators:
`@register_advantage("my_est")`, `@register_policy_loss("my_loss")`, `@register_kl("my_kl")`.
"""

from .advantages import (ADVANTAGE_ESTIMATORS, AdvantageInputs, EstimatorInfo, compute_advantage, estimator_info,
                         get_advantage_estimator, register_advantage)
from .aggregation import LOSS_AGG_MODES, AggNorm, agg_loss, agg_norm
from .kl import (KL_ESTIMATORS, AdaptiveKLController, FixedKLController, apply_kl_in_reward, is_kl_estimator,
                 kl_penalty, make_kl_controller, register_kl)
from .losses import POLICY_LOSSES, LossSettings, get_policy_loss, register_policy_loss, value_loss
from .rollout_correction import rollout_is_weights
from .stats import group_ids, masked_mean, masked_var, masked_whiten

__all__ = [
    "ADVANTAGE_ESTIMATORS", "AdvantageInputs", "EstimatorInfo", "compute_advantage", "estimator_info", "get_advantage_estimator",
    "register_advantage", "LOSS_AGG_MODES", "AggNorm", "agg_loss", "agg_norm", "KL_ESTIMATORS",
    "AdaptiveKLController", "FixedKLController", "apply_kl_in_reward", "is_kl_estimator", "kl_penalty",
    "make_kl_controller", "register_kl", "POLICY_LOSSES", "LossSettings", "rollout_is_weights", "get_policy_loss", "register_policy_loss", "value_loss",
    "group_ids", "masked_mean", "masked_var", "masked_whiten",
]
