"""Whether a sharded run applied the one-process run's update: the bounds of the equivalence tests, and why.

What sharding must preserve is the gradient: the same rows give the same loss, whose gradient is summed over the
ranks. Sums taken in another order (another split of the rows, another CPU's kernels: AVX2 and AVX-512 accumulate
differently) differ by float rounding, about 1e-7 of the largest terms.

Gradients (after clipping, as the optimizer applies them). A role's first optimizer step runs on the same weights
in every layout, so every coordinate must agree within 1e-5 of the step's largest gradient (seen: 5e-7). Later steps
run on weights that may already differ (below), so their gradients are compared as a whole: relative L2 difference
below 1e-3 (seen: 5e-7). A wrong gradient (a rank's rows missing, a normaliser off by the world size) is off by O(1).

Weights. AdamW moves a coordinate by lr * m / (sqrt(v) + eps) per step: at the first step lr * g / (|g| + eps) —
about lr whatever the gradient's scale — and never more than lr * max(1, (1 - b1) / sqrt(1 - b2)) (Kingma & Ba,
section 2.1). A gradient within rounding of zero (its sign, or its size next to eps = 1e-8, set by rounding) can
therefore send its weight anywhere within that step, one way in one run and the other way in another: up to twice
the bound apart per step (seen: 1.6e-5 at lr 1e-3 after 2 steps on an AVX2-only CPU, 8e-7 on an AVX-512 one). So
each coordinate is bounded by 2 * sum(bound * lr_t) over the steps, and such coordinates must be rare: at most 0.1%
may differ by more than 1% of sum(lr_t) (seen: one in 108k), and the mean difference is below 1e-4 * sum(lr_t) (seen:
3e-7 of it).

A bound on the largest weight difference alone is both too strict (it depends on the CPU) and nearly blind: Adam's
first step does not depend on the gradient's scale, so a gradient off by a constant factor moves only the weights
whose gradient is near eps.
"""

from __future__ import annotations

import math

import torch

BETAS = (0.9, 0.999)  # posttrain's default optim.betas (AdamW), which the equivalence tests keep
ADAM_STEP = max(1.0, (1 - BETAS[0]) / math.sqrt(1 - BETAS[1]))  # the largest step of a coordinate, in units of lr


def assert_same_gradients(want_steps: list[dict], got_steps: list[dict], what) -> None:
    """`*_steps`: one {"lr", "grads": {name: tensor}} per optimizer step (tests/dist_worker.py records them)."""
    assert len(got_steps) == len(want_steps), (what, len(got_steps), len(want_steps))
    for step, (want, got) in enumerate(zip(want_steps, got_steps)):
        assert got["lr"] == want["lr"] and got["grads"].keys() == want["grads"].keys(), (what, step)
        w = torch.cat([g.flatten().double() for g in want["grads"].values()])
        g = torch.cat([got["grads"][k].flatten().double() for k in want["grads"]])
        if step == 0:  # the same weights in every layout: rounding only
            error, bound = float((g - w).abs().max()), 1e-5 * float(w.abs().max())
        else:  # weights that may differ by a few Adam steps in a few coordinates
            error, bound = float((g - w).norm()), 1e-3 * float(w.norm())
        assert error <= bound, (what, f"step {step}", error, bound)


def assert_same_weights(want_state: dict, got_state: dict, steps: list[dict], what) -> None:
    """Weights after `steps` (as recorded for the gradients) of AdamW from the same start."""
    assert got_state.keys() == want_state.keys(), what
    diffs = torch.cat([(got_state[k].double() - v.double()).abs().flatten() for k, v in want_state.items()])
    lr_sum = sum(step["lr"] for step in steps)
    largest = 2 * ADAM_STEP * lr_sum  # a coordinate whose every step went the other way
    apart = float((diffs > 0.01 * lr_sum).double().mean())  # coordinates more than rounding apart
    assert float(diffs.max()) <= largest, (what, "largest", float(diffs.max()), largest)
    assert apart <= 1e-3, (what, "share of coordinates apart", apart)
    assert float(diffs.mean()) <= 1e-4 * lr_sum, (what, "mean", float(diffs.mean()), 1e-4 * lr_sum)


def assert_same_training(want: dict, got: dict, what) -> None:
    """Every trained role of two dist_worker results: gradients, then weights."""
    assert got["states"].keys() == want["states"].keys(), what
    for role, state in want["states"].items():
        assert want["steps"][role], (what, role, "no optimizer step was taken")
        assert_same_gradients(want["steps"][role], got["steps"][role], (what, role))
        assert_same_weights(state, got["states"][role], want["steps"][role], (what, role))
