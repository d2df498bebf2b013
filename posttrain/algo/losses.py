"""Policy losses (`actor.policy_loss.loss_mode`) and the critic's clipped value loss.

Every policy loss has one signature, so the actor calls them all the same way and a misspelt keyword raises:

    loss_fn(log_prob, old_log_prob, advantages, response_mask, *, settings: LossSettings, norm: AggNorm | None,
            rollout_is_weights: Tensor | None) -> (scalar loss, metrics)

with (B, L) tensors. `settings` holds the configured constants (one object, built once from the actor config);
`norm` is the mini-batch normaliser passed on to `agg_loss`; `rollout_is_weights` (rollout correction, detached)
multiply the per-token loss. `register_policy_loss` checks the signature, so a user's loss follows it too.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .aggregation import AggNorm, agg_loss
from .registry import Registry, check_signature
from .stats import masked_mean


@dataclass(frozen=True)
class LossSettings:
    """The constants a policy loss reads (verl's actor keys; defaults are verl's)."""

    loss_agg_mode: str = "token-mean"
    clip_ratio_low: float = 0.2  # for dppo_*: the divergence threshold below / above
    clip_ratio_high: float = 0.2
    clip_ratio_c: float = 3.0  # dual-clip bound; for dppo_*: the cap of the (detached) ratio
    const: float | None = None  # C of seq-mean-token-sum-norm when no mini-batch `norm` is given
    clip_cov_ratio: float = 0.0002
    clip_cov_lb: float = 1.0
    clip_cov_ub: float = 5.0
    kl_cov_ratio: float = 0.0002
    ppo_kl_coef: float = 0.1
    tau_pos: float = 1.0  # sapo
    tau_neg: float = 1.05
    dro_beta: float | None = None  # dro: the quadratic log-ratio penalty (required there)


DEFAULT_SETTINGS = LossSettings()
POSITIONAL = ("log_prob", "old_log_prob", "advantages", "response_mask")
KEYWORDS = ("settings", "norm", "rollout_is_weights")

POLICY_LOSSES: Registry = Registry("policy loss (actor.policy_loss.loss_mode)")


def register_policy_loss(*names: str, override: bool = False):
    """Decorator: `@register_policy_loss("my_loss")` makes `actor.policy_loss.loss_mode=my_loss` work."""
    register = POLICY_LOSSES.register(*names, override=override)

    def decorate(fn):
        check_signature(fn, POSITIONAL, KEYWORDS, "policy loss")
        return register(fn)

    return decorate


def get_policy_loss(name: str):
    return POLICY_LOSSES.get(name)


def _ratio(log_prob: Tensor, old_log_prob: Tensor) -> tuple[Tensor, Tensor]:
    delta = torch.clamp(log_prob - old_log_prob, -20.0, 20.0)
    return delta, delta.exp()


def finish(loss_mat: Tensor, mask: Tensor, mode: str, s: LossSettings, norm, weights) -> Tensor:
    """Apply rollout-correction weights, then aggregate: the last step every loss shares."""
    if weights is not None:
        loss_mat = loss_mat * weights
    return agg_loss(loss_mat, mask, mode, norm, s.const)


def _zero() -> Tensor:
    return torch.zeros(())


@register_policy_loss("vanilla")
def vanilla(log_prob, old_log_prob, advantages, response_mask, *, settings: LossSettings = DEFAULT_SETTINGS,
            norm: AggNorm | None = None, rollout_is_weights: Tensor | None = None):
    """PPO clipped surrogate with dual-clip (bounded by -A*c for negative advantages)."""
    s = settings
    delta, ratio = _ratio(log_prob, old_log_prob)
    A = advantages
    l1 = -A * ratio
    l2 = -A * torch.clamp(ratio, 1 - s.clip_ratio_low, 1 + s.clip_ratio_high)
    lc = torch.maximum(l1, l2)
    l3 = -A * s.clip_ratio_c
    loss = torch.where(A < 0, torch.minimum(lc, l3), lc)
    m = response_mask
    metrics = {
        "actor/pg_clipfrac": masked_mean((l2 > l1).float(), m).detach(),
        "actor/ppo_kl": masked_mean(-delta, m).detach(),
        "actor/pg_clipfrac_lower": masked_mean(((lc > l3) & (A < 0)).float(), m).detach(),
    }
    return finish(loss, m, s.loss_agg_mode, s, norm, rollout_is_weights), metrics


@register_policy_loss("gpg")
def gpg(log_prob, old_log_prob, advantages, response_mask, *, settings: LossSettings = DEFAULT_SETTINGS,
        norm: AggNorm | None = None, rollout_is_weights: Tensor | None = None):
    """GPG: plain policy gradient -logp * A, no ratio and no clip."""
    loss = -log_prob * advantages
    metrics = {"actor/ppo_kl": masked_mean(old_log_prob - log_prob, response_mask).detach(),
               "actor/pg_clipfrac": _zero(), "actor/pg_clipfrac_lower": _zero()}
    return finish(loss, response_mask, settings.loss_agg_mode, settings, norm, rollout_is_weights), metrics


@register_policy_loss("gspo")
def gspo(log_prob, old_log_prob, advantages, response_mask, *, settings: LossSettings = DEFAULT_SETTINGS,
         norm: AggNorm | None = None, rollout_is_weights: Tensor | None = None):
    """GSPO: sequence-level ratio (length-normalised) carried by token-level gradients; always seq-mean-token-mean."""
    s = settings
    m = response_mask.to(log_prob.dtype)
    lengths = m.sum(-1).clamp(min=1)
    seq_log_ratio = ((log_prob - old_log_prob) * m).sum(-1) / lengths
    log_s = log_prob - log_prob.detach() + seq_log_ratio.detach().unsqueeze(-1)
    ratio = torch.exp(torch.clamp(log_s, max=10.0))
    l1 = -advantages * ratio
    l2 = -advantages * torch.clamp(ratio, 1 - s.clip_ratio_low, 1 + s.clip_ratio_high)
    loss = torch.maximum(l1, l2)
    metrics = {"actor/pg_clipfrac": masked_mean((l2 > l1).float(), m).detach(),
               "actor/ppo_kl": masked_mean(old_log_prob - log_prob, m).detach(),
               "actor/pg_clipfrac_lower": _zero()}
    return finish(loss, m, "seq-mean-token-mean", s, norm, rollout_is_weights), metrics


@register_policy_loss("cispo")
def cispo(log_prob, old_log_prob, advantages, response_mask, *, settings: LossSettings = DEFAULT_SETTINGS,
          norm: AggNorm | None = None, rollout_is_weights: Tensor | None = None):
    """CISPO: the clipped ratio is a stop-gradient weight on -A * logp, so every token keeps a gradient."""
    s = settings
    delta, ratio = _ratio(log_prob, old_log_prob)
    clipped = torch.clamp(ratio, 1 - s.clip_ratio_low, 1 + s.clip_ratio_high)
    loss = -clipped.detach() * advantages * log_prob
    metrics = {"actor/pg_clipfrac": masked_mean((clipped != ratio).float(), response_mask).detach(),
               "actor/ppo_kl": masked_mean(-delta, response_mask).detach(),
               "actor/pg_clipfrac_lower": _zero()}
    return finish(loss, response_mask, s.loss_agg_mode, s, norm, rollout_is_weights), metrics


@register_policy_loss("sapo")
def sapo(log_prob, old_log_prob, advantages, response_mask, *, settings: LossSettings = DEFAULT_SETTINGS,
         norm: AggNorm | None = None, rollout_is_weights: Tensor | None = None):
    """SAPO (arXiv 2511.20347): a smooth sigmoid gate 4/tau * sigmoid(tau (r - 1)) replaces the hard clip, with a
    steeper tau for negative advantages; like verl, always seq-mean-token-mean."""
    s = settings
    delta, ratio = _ratio(log_prob, old_log_prob)
    tau = torch.where(advantages > 0, torch.full_like(ratio, s.tau_pos), torch.full_like(ratio, s.tau_neg))
    gate = torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau)
    loss = -gate * advantages
    metrics = {"actor/pg_clipfrac": _zero(), "actor/ppo_kl": masked_mean(-delta, response_mask).detach(),
               "actor/pg_clipfrac_lower": _zero()}
    return finish(loss, response_mask, "seq-mean-token-mean", s, norm, rollout_is_weights), metrics


@register_policy_loss("geo_mean")
def geo_mean(log_prob, old_log_prob, advantages, response_mask, *, settings: LossSettings = DEFAULT_SETTINGS,
             norm: AggNorm | None = None, rollout_is_weights: Tensor | None = None):
    """GMPO (arXiv 2507.20673): the geometric mean of the token ratios (each log-ratio clipped to
    [-eps_low, eps_high] on the side the advantage's sign pushes) times the sequence's mean advantage.

    One term per sequence: `loss_i = -mean_t(A) * exp(mean_t(clipped log-ratio))`, averaged over the mini-batch's
    sequences (loss_agg_mode is not read; as in verl). Rollout-correction weights enter as their geometric mean.
    """
    s = settings
    m = response_mask.to(log_prob.dtype)
    delta = log_prob - old_log_prob
    sign = torch.sign(advantages)
    clamped = torch.clamp(delta, -s.clip_ratio_low, s.clip_ratio_high)
    d = sign * torch.minimum(sign * delta, sign * clamped)
    n = m.sum(-1)
    ratio = torch.exp((d * m).sum(-1) / (n + 1e-8))
    adv = (advantages * m).sum(-1) / (n + 1e-8)
    seq_loss = -adv * ratio
    if rollout_is_weights is not None:
        seq_loss = seq_loss * torch.exp((torch.log(rollout_is_weights.clamp(min=1e-10)) * m).sum(-1) / (n + 1e-8))
    # mean over sequences: the mini-batch's sequence count when split into micro-batches
    rows = norm.seqs if norm is not None else float((n > 0).sum())
    loss = (seq_loss * (n > 0)).sum() / max(rows, 1.0)
    clipped = (delta != clamped).float()
    metrics = {"actor/pg_clipfrac": masked_mean(clipped * (advantages > 0), m).detach(),
               "actor/ppo_kl": masked_mean(-delta, m).detach(),
               "actor/pg_clipfrac_lower": masked_mean(clipped * (advantages < 0), m).detach()}
    return loss, metrics


def value_loss(vpreds: Tensor, old_values: Tensor, returns: Tensor, response_mask: Tensor, *, cliprange_value=0.5,
               loss_agg_mode="token-mean", norm: AggNorm | None = None, const=None) -> tuple[Tensor, dict]:
    """0.5 * agg(max((v - R)^2, (clip(v, v_old +- c) - R)^2)) and the share of tokens where the clip was worse."""
    v_clip = torch.clamp(vpreds, old_values - cliprange_value, old_values + cliprange_value)
    unclipped, clipped = (vpreds - returns) ** 2, (v_clip - returns) ** 2
    loss = 0.5 * agg_loss(torch.maximum(unclipped, clipped), response_mask, loss_agg_mode, norm, const)
    return loss, {"critic/vf_clipfrac": masked_mean((clipped > unclipped).float(), response_mask).detach()}


from . import losses_cov, losses_dppo, losses_dro  # noqa: F401  (register the remaining losses)
