"""DRO (Direct Reward Optimization; Richemond et al. 2024, arXiv 2405.19107, and Kimi k1.5, arXiv 2501.12599): the
policy gradient with a quadratic penalty on the log-ratio to the policy that sampled, instead of a clip:

    loss = agg(-(logp * A - beta / 2 * (logp - logp_old)^2))

with beta = `actor.policy_loss.dro_beta` (> 0, required), as verl's `dro` loss. The penalty's gradient pulls each
token's log-prob back towards the old one in proportion to how far it moved, so the update stays near the sampling
policy without a hard trust region. DRO expects advantages built for its soft off-policy objective (verl leaves that
to the caller too); any estimator runs.
"""

from __future__ import annotations

from .aggregation import AggNorm
from .losses import DEFAULT_SETTINGS, LossSettings, _zero, finish, register_policy_loss
from .stats import masked_mean


@register_policy_loss("dro")
def dro(log_prob, old_log_prob, advantages, response_mask, *, settings: LossSettings = DEFAULT_SETTINGS,
        norm: AggNorm | None = None, rollout_is_weights=None):
    beta = settings.dro_beta
    if beta is None or beta <= 0:
        raise ValueError("policy_loss.loss_mode=dro needs actor_rollout_ref.actor.policy_loss.dro_beta > 0")
    log_ratio = log_prob - old_log_prob
    loss = -(log_prob * advantages - 0.5 * beta * log_ratio.square())
    metrics = {"actor/ppo_kl": masked_mean(-log_ratio, response_mask).detach(),
               "actor/pg_clipfrac": _zero(), "actor/pg_clipfrac_lower": _zero()}
    return finish(loss, response_mask, settings.loss_agg_mode, settings, norm, rollout_is_weights), metrics
