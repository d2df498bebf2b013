"""KL estimators, the `+` straight-through variants, KL controllers and KL in the reward (ALGORITHMS.md)."""

import math
import random

import pytest
import torch

import algo_reference as ref
from algo_reference import single_torch_thread  # noqa: F401  (autouse fixture)
from posttrain.algo import (AdaptiveKLController, FixedKLController, apply_kl_in_reward, is_kl_estimator,
                            kl_penalty, make_kl_controller)

F64 = torch.float64
BASE = ["kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3"]
D_VALUES = [-1e4, -25.0, -20.5, -3.0, -2.3, -1.0, -0.3, -1e-3, 0.0, 1e-3, 0.4, 1.0, 2.0, 5.0, 19.0, 21.0, 1e4]


def pair(ds, seed=0):
    rng = random.Random(seed)
    ref_lp = [-rng.uniform(0.1, 3.0) for _ in ds]
    lp = [r + d for r, d in zip(ref_lp, ds)]
    return lp, ref_lp


def own_base_grad(d, kind):
    """d kl / d logp of the base estimators, from the spec formulas."""
    if kind in ("kl", "k1"):
        return 1.0
    if kind == "abs":
        return math.copysign(1.0, d) if d != 0 else 0.0
    if kind in ("mse", "k2"):
        return d
    x = -d
    if x < -20 or x > 20:
        return 0.0  # the input clamp is saturated
    value = math.exp(x) - x - 1
    if value > 10:
        return 0.0  # the output clamp is saturated
    return 1.0 - math.exp(-d)


@pytest.mark.parametrize("kind", BASE)
def test_base_estimators_value_and_gradient(kind):
    lp, ref_lp = pair(D_VALUES)
    x = torch.tensor(lp, dtype=F64, requires_grad=True)
    y = torch.tensor(ref_lp, dtype=F64)
    out = kl_penalty(x, y, kind)
    out.sum().backward()
    assert torch.isfinite(out).all() and torch.isfinite(x.grad).all()
    for k, (a, b) in enumerate(zip(lp, ref_lp)):
        d = a - b  # the same float64 difference the estimator sees
        assert abs(out[k].item() - ref.kl_value(d, kind)) <= 1e-9 * max(1.0, abs(d)), (kind, d)
        if d != 0 or kind not in ("abs",):
            assert abs(x.grad[k].item() - own_base_grad(d, kind)) <= 1e-9 * max(1.0, abs(d)), (kind, d)


@pytest.mark.parametrize("kind", BASE)
def test_plus_variants_value_of_base_gradient_of_k2(kind):
    lp, ref_lp = pair(D_VALUES, seed=1)
    x = torch.tensor(lp, dtype=F64, requires_grad=True)
    y = torch.tensor(ref_lp, dtype=F64)
    out = kl_penalty(x, y, kind + "+")
    out.sum().backward()
    assert torch.isfinite(out).all() and torch.isfinite(x.grad).all()
    for k, (a, b) in enumerate(zip(lp, ref_lp)):
        d = a - b
        assert abs(out[k].item() - ref.kl_value(d, kind)) <= 1e-9 * max(1.0, abs(d)), (kind, d)
        assert abs(x.grad[k].item() - d) <= 1e-9 * max(1.0, abs(d)), (kind, d, x.grad[k].item())


def test_k3_hand_and_clamps():
    y = torch.zeros(5, dtype=F64)
    x = torch.tensor([2.0, 0.0, -1e4, 1e4, -3.0], dtype=F64)
    out = kl_penalty(x, y, "low_var_kl")
    # d=2: e^-2 + 2 - 1 = 1.1353352832 ; d=0: 0 ; d=-1e4: x clamps to 20, e^20-21 -> 10 ; d=1e4: e^-20+19 -> 10
    # d=-3: e^3 - 3 - 1 = 16.0855 -> 10
    expect = [math.exp(-2) + 1, 0.0, 10.0, 10.0, 10.0]
    assert torch.allclose(out, torch.tensor(expect, dtype=F64), atol=1e-12)


def test_kl_values_on_matrices():
    rng = random.Random(5)
    LP = [[-rng.uniform(0, 3) for _ in range(6)] for _ in range(4)]
    RF = [[-rng.uniform(0, 3) for _ in range(6)] for _ in range(4)]
    for kind in BASE:
        out = kl_penalty(torch.tensor(LP, dtype=F64), torch.tensor(RF, dtype=F64), kind).tolist()
        for i in range(4):
            for j in range(6):
                assert abs(out[i][j] - ref.kl_value(LP[i][j] - RF[i][j], kind)) < 1e-12


def test_unknown_kl_hint():
    x = torch.zeros(2, dtype=F64)
    with pytest.raises(KeyError, match="Did you mean 'low_var_kl'"):
        kl_penalty(x, x, "low_var_kll")
    with pytest.raises(KeyError, match="Did you mean 'low_var_kl'"):
        kl_penalty(x, x, "low_var_kll+")
    assert is_kl_estimator("k3+") and is_kl_estimator("abs") and is_kl_estimator("mse+")
    assert not is_kl_estimator("k4") and not is_kl_estimator("nope+")


# ----------------------------------------------------------------------------- controllers


def test_fixed_controller():
    ctrl = make_kl_controller("fixed", kl_coef=0.05)
    assert isinstance(ctrl, FixedKLController)
    for kl, n in [(10.0, 8), (0.0, 3)]:
        ctrl.update(kl, n)
        assert ctrl.value == 0.05
    other = make_kl_controller("fixed", kl_coef=1.0)
    other.load_state_dict(ctrl.state_dict())
    assert other.value == 0.05


def adaptive_hand(beta, target, horizon, steps):
    out = []
    for kl, n in steps:
        err = kl / target - 1
        err = max(-0.2, min(0.2, err))
        beta = beta * (1 + err * n / horizon)
        out.append(beta)
    return out


STEPS = [(0.2, 8), (0.01, 8), (0.05, 4), (0.06, 16), (0.0, 1), (0.049, 32), (1e3, 7)]


def test_adaptive_controller_sequence_and_state_dict():
    ctrl = make_kl_controller("adaptive", kl_coef=0.1, target_kl=0.05, horizon=100)
    assert isinstance(ctrl, AdaptiveKLController)
    expect = adaptive_hand(0.1, 0.05, 100, STEPS)
    for (kl, n), e in zip(STEPS[:4], expect[:4]):
        ctrl.update(kl, n)
        assert abs(ctrl.value - e) < 1e-15
    # round trip mid-sequence into a fresh controller built with another coefficient
    resumed = make_kl_controller("adaptive", kl_coef=123.0, target_kl=0.05, horizon=100)
    resumed.load_state_dict(ctrl.state_dict())
    for (kl, n), e in zip(STEPS[4:], expect[4:]):
        ctrl.update(kl, n)
        resumed.update(kl, n)
        assert abs(ctrl.value - e) < 1e-15 and resumed.value == ctrl.value


def test_adaptive_hand_numbers():
    # kl = 2*target -> error clipped to +0.2 ; beta = 0.1 * (1 + 0.2 * 10/100) = 0.102
    ctrl = make_kl_controller("adaptive", kl_coef=0.1, target_kl=0.05, horizon=100)
    ctrl.update(0.1, 10)
    assert abs(ctrl.value - 0.102) < 1e-15
    # kl = 0.04 -> error -0.2 exactly ; beta = 0.102 * (1 - 0.2 * 50/100) = 0.0918
    ctrl.update(0.04, 50)
    assert abs(ctrl.value - 0.0918) < 1e-15


@pytest.mark.parametrize("kwargs", [dict(target_kl=0.0), dict(horizon=0), dict(target_kl=-1.0)])
def test_adaptive_controller_rejects_bad_settings(kwargs):
    with pytest.raises(ValueError):
        make_kl_controller("adaptive", kl_coef=0.1, **kwargs)


def test_unknown_controller():
    with pytest.raises(ValueError, match="adaptive"):
        make_kl_controller("adaptve", kl_coef=0.1)


# ----------------------------------------------------------------------------- KL in the reward


@pytest.mark.parametrize("layout", ref.LAYOUTS)
@pytest.mark.parametrize("kind", ["kl", "low_var_kl", "abs", "k2", "k3+"])
def test_apply_kl_in_reward_sequence(kind, layout):
    rng = random.Random(21)
    target, horizon = 0.02, 50
    ctrl = make_kl_controller("adaptive", kl_coef=0.2, target_kl=target, horizon=horizon)
    beta = 0.2
    for step in range(4):
        B, L = rng.randint(2, 6), rng.randint(2, 7)
        M = ref.layout_mask(rng, B, L, layout)
        L = len(M[0])
        S = [[rng.uniform(-1, 1) if rng.random() < 0.3 else 0.0 for _ in range(L)] for _ in range(B)]
        OLD = [[-rng.uniform(0.1, 2) for _ in range(L)] for _ in range(B)]
        RF = [[o + rng.uniform(-0.4, 0.4) for o in row] for row in OLD]
        rewards, metrics = apply_kl_in_reward(torch.tensor(S, dtype=F64), torch.tensor(OLD, dtype=F64),
                                              torch.tensor(RF, dtype=F64), torch.tensor(M, dtype=F64), ctrl, kind)
        # r = scores - beta * kl(logp_old, logp_ref) * m, with the beta before this step's update
        KL = [[ref.kl_value(OLD[i][j] - RF[i][j], kind) for j in range(L)] for i in range(B)]
        for i in range(B):
            for j in range(L):
                e = S[i][j] - beta * KL[i][j] * M[i][j]
                assert abs(rewards[i, j].item() - e) < 1e-12
        per_resp = [ref.masked_mean(KL[i], M[i]) for i in range(B)]
        batch_kl = sum(per_resp) / B
        assert abs(metrics["actor/reward_kl_penalty"] - batch_kl) < 1e-12
        assert abs(metrics["actor/reward_kl_penalty_coeff"] - beta) < 1e-15
        beta = adaptive_hand(beta, target, horizon, [(batch_kl, B)])[0]
        assert abs(ctrl.value - beta) < 1e-14


def test_apply_kl_in_reward_fixed_bool_mask():
    scores = torch.tensor([[0.0, 1.0, 0.0]], dtype=F64)
    old = torch.tensor([[-1.0, -1.0, -1.0]], dtype=F64)
    refl = torch.tensor([[-1.5, -0.5, -9.0]], dtype=F64)
    m = torch.tensor([[True, True, False]])
    ctrl = make_kl_controller("fixed", kl_coef=0.1)
    rewards, metrics = apply_kl_in_reward(scores, old, refl, m, ctrl)  # kind defaults to "kl" (k1)
    # k1 = [0.5, -0.5, masked] -> r = [-0.05, 1.05, 0] ; batch kl = 0/2
    assert torch.allclose(rewards, torch.tensor([[-0.05, 1.05, 0.0]], dtype=F64), atol=1e-12)
    assert abs(metrics["actor/reward_kl_penalty"]) < 1e-12 and metrics["actor/reward_kl_penalty_coeff"] == 0.1
    assert ctrl.value == 0.1


# ----------------------------------------------------------------------------- on-policy distillation

from posttrain.algo import LossSettings  # noqa: E402
from posttrain.algo.distill import (DistillSettings, combine, distillation_term, forward_kl_topk,  # noqa: E402
                                    reverse_kl_estimate)


def _distill_batch(seed, B=3, L=5):
    rng = random.Random(seed)
    M = ref.random_mask(rng, B, L)
    S = [[-rng.uniform(0.05, 4.0) for _ in range(L)] for _ in range(B)]
    T = [[-rng.uniform(0.05, 4.0) for _ in range(L)] for _ in range(B)]
    return M, S, T


@pytest.mark.parametrize("mode", ["k3", "low_var_kl", "k2", "abs"])
@pytest.mark.parametrize("agg_mode", ["token-mean", "seq-mean-token-mean"])
def test_reverse_kl_as_a_loss_value_and_gradient(mode, agg_mode):
    """GKD: agg(D(d)) with d = logp_student - logp_teacher; its gradient in logp is agg's weight times dD/dd."""
    M, S, T = _distill_batch(3)
    lp = torch.tensor(S, dtype=F64, requires_grad=True)
    per_token = reverse_kl_estimate(lp, torch.tensor(T, dtype=F64), mode)
    s = DistillSettings(loss_mode=mode).check()
    loss, metrics = distillation_term(per_token, lp, lp.detach(), torch.tensor(M, dtype=F64), settings=s,
                                      loss_settings=LossSettings(loss_agg_mode=agg_mode))
    loss.backward()
    D = [[ref.kl_value(S[i][t] - T[i][t], mode) for t in range(5)] for i in range(3)]
    assert abs(loss.item() - ref.agg(D, M, agg_mode)) < 1e-12
    for i in range(3):
        for t in range(5):
            e = [[1.0 if (a, b) == (i, t) else 0.0 for b in range(5)] for a in range(3)]
            weight = ref.agg(e, M, agg_mode)  # d agg / d D[i][t]
            assert abs(lp.grad[i, t].item() - weight * own_base_grad(S[i][t] - T[i][t], mode)) < 1e-12
    assert abs(metrics["actor/distillation/abs_loss"].item()
               - ref.masked_mean([abs(v) for v in ref.flat(D)], ref.flat(M))) < 1e-12


@pytest.mark.parametrize("mode", ["k1", "k3"])
def test_reverse_kl_as_a_reward_through_the_policy_gradient(mode):
    """PG OPD: the vanilla PPO loss with per-token advantages -D_t (no gradient through D), the distillation clip
    range; at ratio 1 the gradient in logp_t is -A_t / tokens, and off ratio 1 the clip and dual clip apply."""
    M, S, T = _distill_batch(4)
    rng = random.Random(5)
    OLD = [[v + rng.uniform(-0.4, 0.4) for v in row] for row in S]
    s = DistillSettings(loss_mode=mode, use_policy_gradient=True, clip_ratio_low=0.1, clip_ratio_high=0.3).check()
    D = [[ref.kl_value(S[i][t] - T[i][t], mode) for t in range(5)] for i in range(3)]
    A = [[-v for v in row] for row in D]
    for old in (None, OLD):
        lp = torch.tensor(S, dtype=F64, requires_grad=True)
        per_token = reverse_kl_estimate(lp, torch.tensor(T, dtype=F64), mode)
        old_t = lp.detach() if old is None else torch.tensor(old, dtype=F64)
        loss, metrics = distillation_term(per_token, lp, old_t, torch.tensor(M, dtype=F64), settings=s,
                                          loss_settings=LossSettings())
        want, want_metrics = ref.vanilla(S, S if old is None else old, A, M, "token-mean", 0.1, 0.3, 3.0)
        assert abs(loss.item() - want) < 1e-12
        assert abs(metrics["actor/distillation/pg_clipfrac"].item() - want_metrics["actor/pg_clipfrac"]) < 1e-12
        loss.backward()
        if old is None:
            n = sum(ref.flat(M))
            for i in range(3):
                for t in range(5):
                    assert abs(lp.grad[i, t].item() - (-A[i][t] * M[i][t] / n)) < 1e-12


@pytest.mark.parametrize("min_clamp", [None, -3.0])
def test_forward_kl_topk_value_masses_and_gradient(min_clamp):
    """Top-k forward KL from full logits: the teacher's k ids and log-probs, the student's log-probs at those ids
    from its whole-vocabulary softmax; value, both masses, and the gradient in the student's logits."""
    rng = random.Random(6)
    V, K, N = 11, 4, 6
    for _ in range(N):
        zs = [rng.gauss(0, 2) for _ in range(V)]
        zt = [rng.gauss(0, 2) for _ in range(V)]
        ids, t_lp = ref.teacher_topk(zt, K)
        z = torch.tensor(zs, dtype=F64, requires_grad=True)
        s_lp = torch.log_softmax(z, -1)[torch.tensor(ids)]
        kl, s_mass, t_mass = forward_kl_topk(s_lp, torch.tensor(t_lp, dtype=F64), min_clamp)
        want, want_s, want_t = ref.forward_kl_topk(zs, ids, t_lp, min_clamp)
        assert abs(kl.item() - want) < 1e-12 and abs(s_mass.item() - want_s) < 1e-12
        assert abs(t_mass.item() - want_t) < 1e-12
        if min_clamp is None and want > 0:
            kl.backward()
            for j, g in enumerate(ref.forward_kl_topk_grad(zs, ids, t_lp)):
                assert abs(z.grad[j].item() - g) < 1e-12


def test_forward_kl_topk_is_zero_when_student_is_teacher_and_clamped_at_zero():
    """Equal models: 0. The k-token sum can be negative (student mass above the teacher's on the k tokens): 0."""
    t = torch.log_softmax(torch.tensor([[2.0, 1.0, 0.5, -1.0]], dtype=F64), -1)[:, :2]
    assert forward_kl_topk(t, t)[0].item() == 0.0
    s = torch.log(torch.tensor([[0.6, 0.39]], dtype=F64))  # log(0.6/p) with p < 0.6 on the top token
    raw = sum(math.exp(a) * (a - b) for a, b in zip(t[0].tolist(), s[0].tolist()))
    assert raw < 0 and forward_kl_topk(s, t)[0].item() == 0.0


def test_distillation_combines_with_the_task_loss_and_clamps():
    """use_task_rewards: task + coef * distill; without it the distillation loss alone (coefficient 1).
    loss_max_clamp bounds each token's divergence to [-c, c] before aggregation."""
    task, distill = torch.tensor(0.7, dtype=F64), torch.tensor(0.2, dtype=F64)
    assert combine(task, distill, DistillSettings(distillation_loss_coef=3.0)).item() == pytest.approx(1.3, abs=1e-15)
    assert combine(task, distill, DistillSettings(distillation_loss_coef=3.0, use_task_rewards=False)).item() == 0.2
    M = [[1.0, 1.0, 1.0]]
    per_token = torch.tensor([[5.0, -7.0, 0.5]], dtype=F64)
    s = DistillSettings(loss_mode="k2", loss_max_clamp=2.0)
    lp = torch.zeros(1, 3, dtype=F64)
    loss, _ = distillation_term(per_token, lp, lp, torch.tensor(M, dtype=F64), settings=s,
                                loss_settings=LossSettings())
    assert loss.item() == pytest.approx((2.0 - 2.0 + 0.5) / 3, abs=1e-15)


def test_distillation_settings_refuse_what_has_no_meaning():
    """k1 backpropagated directly has a teacher-free gradient; unknown modes and topk < 1 are refused;
    top-k through the policy gradient warns (the distribution over k tokens is mostly unused)."""
    for mode in ("k1", "kl"):
        with pytest.raises(ValueError, match="use_policy_gradient"):
            DistillSettings(loss_mode=mode).check()
        DistillSettings(loss_mode=mode, use_policy_gradient=True).check()
    with pytest.raises(ValueError, match="loss_mode 'k4'"):
        DistillSettings(loss_mode="k4").check()
    with pytest.raises(ValueError, match="topk"):
        DistillSettings(loss_mode="forward_kl_topk", topk=0).check()
    with pytest.warns(UserWarning, match="GKD"):
        DistillSettings(loss_mode="forward_kl_topk", use_policy_gradient=True).check()
