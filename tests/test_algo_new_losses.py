"""clip_cov, kl_cov, sapo, geo_mean, dppo_tv, dppo_kl and rollout-IS weights in the losses, against the float64
re-derivations in algo_reference.py (values) and per-element torch loops (gradients)."""

import math
import random

import algo_reference as ref
import pytest
import torch
from algo_reference import single_torch_thread  # noqa: F401  (autouse fixture)

from posttrain.algo import LOSS_AGG_MODES, LossSettings, get_policy_loss

F64 = torch.float64
C = 13.0


def t(x):
    return torch.tensor(x, dtype=F64)


def call(name, lp, old, A, m, norm=None, rollout_is_weights=None, **settings):
    return get_policy_loss(name)(lp, old, A, m, settings=LossSettings(const=C, **settings), norm=norm,
                                 rollout_is_weights=rollout_is_weights)


def close(a, b, tol=1e-10):
    return abs(float(torch.as_tensor(a).detach()) - b) <= tol * max(1.0, abs(b))


def batch(seed, spread=0.6, adv_scale=2.0, B=None, L=None, lp_range=(0.05, 3.0), layout="holes"):
    rng = random.Random(seed)
    B, L = B or rng.randint(3, 7), L or rng.randint(3, 9)
    M = ref.layout_mask(rng, B, L, layout)
    L = len(M[0])
    OLD = [[-rng.uniform(*lp_range) for _ in range(L)] for _ in range(B)]
    LP = [[min(o + rng.uniform(-spread, spread), -1e-3) for o in row] for row in OLD]
    ADV = [[rng.uniform(-adv_scale, adv_scale) for _ in range(L)] for _ in range(B)]
    return LP, OLD, ADV, M


def grad_of(fn, LP):
    lp = t(LP).requires_grad_(True)
    out = fn(lp)
    (g,) = torch.autograd.grad(out, lp)
    return g


# ----------------------------------------------------------------------------- clip_cov


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
@pytest.mark.parametrize("layout", ref.LAYOUTS)
def test_clip_cov_drops_a_random_budget_of_candidates(seed, mode, layout):
    LP, OLD, ADV, M = batch(40 + seed, spread=0.3, adv_scale=3.0, B=6, L=9, lp_range=(0.05, 4.0), layout=layout)
    lo, hi, lb, ub, share = 0.2, 0.28, 0.05, 5.0, 0.1
    cand = ref.clip_cov_candidates(LP, OLD, ADV, M, lo, hi, lb, ub)
    budget = max(int(share * sum(ref.flat(M))), 1)
    torch.manual_seed(seed)
    lp = t(LP).requires_grad_(True)
    loss, metrics = call("clip_cov", lp, t(OLD), t(ADV), t(M), loss_agg_mode=mode, clip_ratio_low=lo,
                         clip_ratio_high=hi, clip_cov_ratio=share, clip_cov_lb=lb, clip_cov_ub=ub)
    loss.backward()
    # a candidate has a non-zero gradient unless it was dropped: the zero-gradient candidates are the dropped ones
    dropped = {(i, j) for i, j in cand if lp.grad[i, j] == 0}
    assert len(dropped) == min(budget, len(cand))
    assert close(loss, ref.clip_cov(LP, OLD, ADV, M, mode, lo, hi, dropped, C=C))
    assert close(metrics["actor/pg_clipfrac"], len(dropped) / (sum(ref.flat(M)) + 1e-8), 1e-6)


def test_clip_cov_all_candidates_dropped_when_within_budget():
    LP, OLD, ADV, M = batch(7, spread=0.3, adv_scale=3.0, B=5, L=8, lp_range=(0.05, 4.0))
    cand = ref.clip_cov_candidates(LP, OLD, ADV, M, 0.2, 0.2, 1.0, 5.0)
    loss, _ = call("clip_cov", t(LP), t(OLD), t(ADV), t(M), clip_cov_ratio=1.0)
    assert close(loss, ref.clip_cov(LP, OLD, ADV, M, "token-mean", 0.2, 0.2, set(cand), C=C))


# ----------------------------------------------------------------------------- kl_cov


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("share", [0.0002, 0.2, 0.5])
@pytest.mark.parametrize("layout", ref.LAYOUTS)
def test_kl_cov_value(seed, share, layout):
    LP, OLD, ADV, M = batch(60 + seed, layout=layout)
    for mode in LOSS_AGG_MODES:
        loss, _ = call("kl_cov", t(LP), t(OLD), t(ADV), t(M), loss_agg_mode=mode, kl_cov_ratio=share, ppo_kl_coef=0.3)
        assert close(loss, ref.kl_cov(LP, OLD, ADV, M, mode, share, 0.3, C=C))


def test_kl_cov_default_coefficient_is_verls():
    assert LossSettings().ppo_kl_coef == 0.1 and LossSettings().kl_cov_ratio == 0.0002
    LP, OLD, ADV, M = batch(3)
    loss, _ = call("kl_cov", t(LP), t(OLD), t(ADV), t(M))
    assert close(loss, ref.kl_cov(LP, OLD, ADV, M, "token-mean", 0.0002, 0.1))


# ----------------------------------------------------------------------------- sapo


def own_sapo(lp, OLD, ADV, M, tp, tn):
    total, S = 0.0, 0
    for i in range(len(M)):
        n = sum(M[i])
        if n == 0:
            continue
        S += 1
        row = 0.0
        for j in range(len(M[i])):
            if M[i][j]:
                A = ADV[i][j]
                tau = tp if A > 0 else tn
                r = torch.exp(lp[i, j] - OLD[i][j])
                row = row - torch.sigmoid(tau * (r - 1)) * 4 / tau * A
        total = total + row / n
    return total / S


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("taus", [(1.0, 1.05), (2.0, 3.0)])
@pytest.mark.parametrize("layout", ref.LAYOUTS)
def test_sapo_value_and_gradient(seed, taus, layout):
    LP, OLD, ADV, M = batch(80 + seed, layout=layout)
    fn = lambda lp: call("sapo", lp, t(OLD), t(ADV), t(M), loss_agg_mode="token-mean", tau_pos=taus[0],
                         tau_neg=taus[1])[0]
    assert close(fn(t(LP)), ref.sapo(LP, OLD, ADV, M, *taus))  # always seq-mean-token-mean, like gspo
    assert torch.allclose(grad_of(fn, LP), grad_of(lambda lp: own_sapo(lp, OLD, ADV, M, *taus), LP), atol=1e-12)


def test_sapo_gate_at_ratio_one_is_the_policy_gradient():
    # d/dr [4/tau sigmoid(tau (r-1))] at r = 1 is 1: the same gradient as -A * ratio on on-policy data
    lp = t([[-1.0, -2.0]]).requires_grad_(True)
    A, m = t([[1.5, -0.5]]), t([[1.0, 1.0]])
    call("sapo", lp, lp.detach(), A, m)[0].backward()
    assert torch.allclose(lp.grad, -A / 2, atol=1e-12)


# ----------------------------------------------------------------------------- geo_mean (GMPO)


def own_geo_mean(lp, OLD, ADV, M, lo, hi):
    total, S = 0.0, 0
    for i in range(len(M)):
        n = sum(M[i])
        if n == 0:
            continue
        S += 1
        s_d, s_a = 0.0, 0.0
        for j in range(len(M[i])):
            if M[i][j]:
                d, A = lp[i, j] - OLD[i][j], ADV[i][j]
                dc = torch.clamp(d, -lo, hi)
                s_d = s_d + (torch.minimum(d, dc) if A > 0 else torch.maximum(d, dc) if A < 0 else 0 * d)
                s_a += A
        total = total - s_a / (n + 1e-8) * torch.exp(s_d / (n + 1e-8))
    return total / S


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("eps", [(0.2, 0.2), (0.4, 0.4)])
@pytest.mark.parametrize("layout", ref.LAYOUTS)
def test_geo_mean_value_and_gradient(seed, eps, layout):
    LP, OLD, ADV, M = batch(100 + seed, layout=layout)
    fn = lambda lp: call("geo_mean", lp, t(OLD), t(ADV), t(M), clip_ratio_low=eps[0],
                         clip_ratio_high=eps[1])[0]
    assert close(fn(t(LP)), ref.geo_mean(LP, OLD, ADV, M, *eps))
    assert torch.allclose(grad_of(fn, LP), grad_of(lambda lp: own_geo_mean(lp, OLD, ADV, M, *eps), LP), atol=1e-12)


# ----------------------------------------------------------------------------- DPPO


def own_dppo(lp, OLD, ADV, M, mode, lo, hi, c, kind):
    rows = []
    for i in range(len(M)):
        row = []
        for j in range(len(M[i])):
            x, old, A = float(lp[i, j].detach()), OLD[i][j], ADV[i][j]
            w = min(math.exp(x - old), c) if ref.dppo_keep(x, old, A, lo, hi, kind) else 0.0
            row.append(-A * w * lp[i, j])
        rows.append(row)
    T = sum(ref.flat(M))
    return sum(v * m for row, mrow in zip(rows, M) for v, m in zip(row, mrow)) / T if mode == "token-mean" else None


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("kind", ["tv", "kl"])
@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
@pytest.mark.parametrize("layout", ref.LAYOUTS)
def test_dppo_value(seed, kind, mode, layout):
    LP, OLD, ADV, M = batch(120 + seed, spread=1.2, lp_range=(0.01, 1.5), layout=layout)
    (lo, hi), c = ((0.1, 0.15) if kind == "tv" else (0.05, 0.08)), 3.0
    loss, metrics = call(f"dppo_{kind}", t(LP), t(OLD), t(ADV), t(M), loss_agg_mode=mode, clip_ratio_low=lo,
                         clip_ratio_high=hi, clip_ratio_c=c)
    assert close(loss, ref.dppo(LP, OLD, ADV, M, mode, lo, hi, c, kind, C=C))
    dropped = [0.0 if ref.dppo_keep(LP[i][j], OLD[i][j], ADV[i][j], lo, hi, kind) else 1.0
               for i in range(len(M)) for j in range(len(M[i]))]
    assert 0 < sum(dropped) < len(dropped), "the case should mask some tokens and keep others"
    assert close(metrics["actor/pg_clipfrac"], ref.masked_mean(dropped, ref.flat(M)), 1e-6)


@pytest.mark.parametrize("kind", ["tv", "kl"])
def test_dppo_gradient(kind):
    LP, OLD, ADV, M = batch(7, spread=1.2, lp_range=(0.01, 1.5))
    lo, hi, c = 0.1, 0.1, 1.5
    fn = lambda lp: call(f"dppo_{kind}", lp, t(OLD), t(ADV), t(M), clip_ratio_low=lo, clip_ratio_high=hi,
                         clip_ratio_c=c)[0]
    assert torch.allclose(grad_of(fn, LP), grad_of(lambda lp: own_dppo(lp, OLD, ADV, M, "token-mean", lo, hi, c, kind),
                                                   LP), atol=1e-12)


# ----------------------------------------------------------------------------- rollout-IS weights in every loss


@pytest.mark.parametrize("name", ["vanilla", "gpg", "cispo", "kl_cov", "sapo", "dppo_tv", "dppo_kl"])
def test_rollout_is_weights_multiply_the_token_loss(name):
    """Weighting every token by w equals the unweighted loss when w = 1, and scaling w scales the loss."""
    LP, OLD, ADV, M = batch(5)
    w = torch.rand(len(M), len(M[0]), dtype=F64, generator=torch.Generator().manual_seed(0)) + 0.5
    base, _ = call(name, t(LP), t(OLD), t(ADV), t(M))
    ones, _ = call(name, t(LP), t(OLD), t(ADV), t(M), rollout_is_weights=torch.ones_like(w))
    twice, _ = call(name, t(LP), t(OLD), t(ADV), t(M), rollout_is_weights=2 * torch.ones_like(w))
    assert close(ones, float(base)) and close(twice, 2 * float(base))
    if name == "vanilla":
        weighted, _ = call(name, t(LP), t(OLD), t(ADV), t(M), rollout_is_weights=w)
        rows = [[ref.vanilla_token(LP[i][j], OLD[i][j], ADV[i][j], 0.2, 0.2, 3.0)[0] * float(w[i, j])
                 for j in range(len(M[i]))] for i in range(len(M))]
        assert close(weighted, ref.agg(rows, M, "token-mean"))


def test_geo_mean_takes_the_geometric_mean_of_the_weights():
    LP, OLD, ADV, M = batch(9)
    w = (torch.rand(len(M), len(M[0]), dtype=F64, generator=torch.Generator().manual_seed(1)) + 0.5)
    loss, _ = call("geo_mean", t(LP), t(OLD), t(ADV), t(M), rollout_is_weights=w)
    assert close(loss, ref.geo_mean(LP, OLD, ADV, M, 0.2, 0.2, W=w.tolist()))
