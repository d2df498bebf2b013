"""KL estimators (`kl_loss_type`, `algorithm.kl_penalty`), KL in the reward, and the KL coefficient controllers."""

from __future__ import annotations

import torch
from torch import Tensor

from .registry import Registry
from .stats import masked_mean

KL_ESTIMATORS: Registry = Registry("KL estimator (kl_loss_type / algorithm.kl_penalty)")
register_kl = KL_ESTIMATORS.register


@register_kl("kl", "k1")
def kl_k1(d: Tensor) -> Tensor:
    return d


@register_kl("abs")
def kl_abs(d: Tensor) -> Tensor:
    return d.abs()


@register_kl("mse", "k2")
def kl_k2(d: Tensor) -> Tensor:
    return 0.5 * d.square()


@register_kl("low_var_kl", "k3")
def kl_k3(d: Tensor) -> Tensor:
    """Schulman's k3 on d = logp - logp_ref, clamped so a huge log-ratio can never give inf."""
    x = torch.clamp(-d, -20, 20)
    return torch.clamp(x.exp() - x - 1, -10, 10)


def is_kl_estimator(name: str) -> bool:
    return name.removesuffix("+") in KL_ESTIMATORS


def kl_penalty(logp: Tensor, ref_logp: Tensor, kind: str) -> Tensor:
    """Per-token KL estimate (B, L). A `+` suffix keeps the value of `kind` with the gradient of k2."""
    d = logp - ref_logp
    if kind.endswith("+"):
        value = KL_ESTIMATORS.get(kind[:-1])(d)
        k2 = kl_k2(d)
        return value.detach() + k2 - k2.detach()  # gradient of k2 only (not value's + k2's)
    return KL_ESTIMATORS.get(kind)(d)


class FixedKLController:
    """beta stays at kl_coef."""

    def __init__(self, kl_coef: float):
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        pass

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = float(state["value"])


class AdaptiveKLController(FixedKLController):
    """beta <- beta * (1 + clip(kl/target - 1, -0.2, 0.2) * n_steps / horizon), after every step."""

    def __init__(self, kl_coef: float, target_kl: float, horizon: int):
        super().__init__(kl_coef)
        self.target, self.horizon = float(target_kl), int(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon


def make_kl_controller(kind: str, kl_coef: float, target_kl: float = 0.1, horizon: int = 10000) -> FixedKLController:
    if kind == "fixed":
        return FixedKLController(kl_coef)
    if kind == "adaptive":
        if target_kl <= 0 or horizon <= 0:
            raise ValueError("algorithm.kl_ctrl adaptive needs target_kl > 0 and horizon > 0")
        return AdaptiveKLController(kl_coef, target_kl, horizon)
    raise ValueError(f"unknown algorithm.kl_ctrl.type '{kind}'; choose 'fixed' or 'adaptive'")


def apply_kl_in_reward(token_level_scores: Tensor, old_logp: Tensor, ref_logp: Tensor, mask: Tensor,
                       controller: FixedKLController, kind: str = "kl") -> tuple[Tensor, dict]:
    """r = scores - beta * kl(logp_old, logp_ref) * m, then the controller steps on the batch KL."""
    mask = mask.to(token_level_scores.dtype)
    kl = kl_penalty(old_logp, ref_logp, kind) * mask
    beta = controller.value
    rewards = token_level_scores - beta * kl
    current_kl = float(masked_mean(kl, mask, dim=-1).mean())
    controller.update(current_kl, n_steps=token_level_scores.shape[0])
    return rewards, {"actor/reward_kl_penalty": current_kl, "actor/reward_kl_penalty_coeff": beta}
