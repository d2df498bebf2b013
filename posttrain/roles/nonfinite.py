"""Non-finite losses and gradients: the optimizer update is skipped and counted, and a run that keeps producing
them stops, naming the quantity that went non-finite first.

A NaN that reaches the weights makes every later step NaN, so an update is skipped when its loss or its global
gradient norm is not finite (the decision is the same on every rank). One bad mini-batch is survivable; many in a
row mean the run is broken (a NaN reward, a diverged model), and training on is only burning compute.
"""

from __future__ import annotations

import math

import torch


class NonFiniteError(RuntimeError):
    """Too many optimizer updates in a row had a non-finite loss or gradient; the message names what went first."""


def first_nonfinite(quantities: list[tuple[str, torch.Tensor | float]], mask: torch.Tensor | None = None) -> str | None:
    """The first of (name, value) pairs, in the order given (the order of computation), holding NaN or inf: its name
    and what it held. (B, L) tensors are read on `mask`'s tokens only (padding may hold anything)."""
    for name, value in quantities:
        t = torch.as_tensor(value).detach()
        if mask is not None and t.shape == mask.shape:
            t = t[mask.to(t.device).bool()]
        bad = ~torch.isfinite(t)
        if bool(bad.any()):
            n_nan = int(torch.isnan(t).sum())
            n_inf = int(bad.sum()) - n_nan
            parts = [f"{n} {kind}" for n, kind in ((n_nan, "NaN"), (n_inf, "inf")) if n]
            return f"{name} ({' and '.join(parts)} of {t.numel()} value{'s' if t.numel() != 1 else ''})"
    return None


class NonFiniteGuard:
    """Counts skipped updates of one role and stops the run after `limit` in a row (0 = never)."""

    def __init__(self, role: str, limit: int):
        self.role, self.limit = role, limit
        self.updates = 0  # optimizer updates attempted by this role in this process
        self.in_a_row = 0
        self._first: str | None = None  # what went non-finite first in the current run of skipped updates
        self._pending: str | None = None  # what went non-finite first in the update in progress

    def loss_not_finite(self, loss: torch.Tensor, quantities: list[tuple[str, torch.Tensor | float]],
                        mask: torch.Tensor | None = None) -> bool:
        """Called per micro-batch with the loss about to be back-propagated and the quantities it came from, in
        the order they were computed; remembers the first non-finite one when the loss is not finite."""
        if math.isfinite(float(loss.detach())):
            return False
        if self._pending is None:
            self._pending = first_nonfinite(quantities, mask) or first_nonfinite([("loss", loss)])
        return True

    def after_update(self, stepped: bool, grad_norm: float) -> None:
        """Count the update; raise NonFiniteError when `limit` updates in a row were skipped."""
        self.updates += 1
        if stepped:
            self.in_a_row, self._first, self._pending = 0, None, None
            return
        self.in_a_row += 1
        reason = self._pending or f"the gradient norm ({grad_norm}) while every loss was finite"
        self._pending = None
        if self._first is None:
            self._first = f"{reason}, in update {self.updates}"
        if self.limit and self.in_a_row >= self.limit:
            raise NonFiniteError(
                f"{self.role}: {self.in_a_row} optimizer updates in a row were skipped because the loss or the "
                f"gradient was not finite; the first non-finite quantity was {self._first}. Training stopped "
                "(trainer.max_nonfinite_updates_in_a_row). Look for NaN/inf rewards or inputs, lower the learning "
                "rate, or resume from the last checkpoint")
