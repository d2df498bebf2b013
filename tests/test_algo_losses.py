"""Policy losses and the value loss against independent float64 re-derivations of ALGORITHMS.md."""

import math
import random

import pytest
import torch

import algo_reference as ref
from algo_reference import single_torch_thread  # noqa: F401  (autouse fixture)
from posttrain.algo import LOSS_AGG_MODES, POLICY_LOSSES, LossSettings, get_policy_loss, rollout_is_weights, value_loss

F64 = torch.float64
C = 13.0  # seq-mean-token-sum-norm constant (loss_scale_factor / max_response_length), != padded length


def call(loss, lp, old, A, m, norm=None, rollout_is_weights=None, **settings):
    """A policy loss by name (or function), with the actor's calling convention; keywords become LossSettings."""
    fn = get_policy_loss(loss) if isinstance(loss, str) else loss
    if loss == "dro":
        settings.setdefault("dro_beta", 0.1)  # required by dro (refused at load without it)
    return fn(lp, old, A, m, settings=LossSettings(**settings), norm=norm, rollout_is_weights=rollout_is_weights)


def t(x, dtype=F64):
    return torch.tensor(x, dtype=dtype)


def close(a, b, atol=1e-10):
    a = float(a.detach()) if isinstance(a, torch.Tensor) else float(a)
    return abs(a - b) <= atol * max(1.0, abs(b))


def batch(seed, B=None, L=None, spread=0.6, adv_per_seq=False, layout="holes"):
    rng = random.Random(seed)
    B = B or rng.randint(3, 7)
    L = L or rng.randint(3, 9)
    M = ref.layout_mask(rng, B, L, layout)
    L = len(M[0])
    OLD = [[-rng.uniform(0.05, 3.0) for _ in range(L)] for _ in range(B)]
    LP = [[o + rng.uniform(-spread, spread) for o in row] for row in OLD]
    if adv_per_seq:
        ADV = [[a] * L for a in (rng.uniform(-2, 2) for _ in range(B))]
    else:
        ADV = [[rng.uniform(-2, 2) for _ in range(L)] for _ in range(B)]
    return LP, OLD, ADV, M


# ----------------------------------------------------------------------------- vanilla (PPO, dual-clip)


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
@pytest.mark.parametrize("eps", [(0.2, 0.2), (0.2, 0.28), (0.1, 0.4)])
@pytest.mark.parametrize("layout", ref.LAYOUTS)
def test_vanilla_value_and_metrics(seed, mode, eps, layout):
    LP, OLD, ADV, M = batch(seed, spread=1.5, layout=layout)  # wide spread: both clips and the dual clip bind
    lo, hi = eps
    loss, metrics = call("vanilla", t(LP), t(OLD), t(ADV), t(M), loss_agg_mode=mode,
                                               clip_ratio_low=lo, clip_ratio_high=hi, clip_ratio_c=3.0, const=C)
    e_loss, e_metrics = ref.vanilla(LP, OLD, ADV, M, mode, lo, hi, 3.0, C)
    assert close(loss, e_loss)
    for key, value in e_metrics.items():
        assert close(metrics[key], value, atol=1e-6), key  # metrics may be float32


def test_vanilla_dual_clip_binds_hand():
    # ratio e^2 = 7.389 with A=-1: l1 = 7.389, l2 = -(-1)*1.2 = 1.2, lc = 7.389 > -A*c = 3 -> loss 3
    # ratio e^0.1 = 1.105 with A=-1: l1 = 1.105, l2 = 1.105 -> loss 1.105 (no clip)
    # ratio e^2 with A=+1: l1 = -7.389, l2 = -1.2 -> loss -1.2 (upper clip, eps_high 0.2)
    # ratio e^-1 = 0.368 with A=-1: l1 = 0.368, l2 = 1 - 0.1 = 0.9 -> loss 0.9 (lower clip, eps_low 0.1)
    lp = t([[2.0, 0.1, 2.0, -1.0]])
    old = t([[0.0, 0.0, 0.0, 0.0]])
    A = t([[-1.0, -1.0, 1.0, -1.0]])
    m = t([[1.0, 1.0, 1.0, 1.0]])
    loss, metrics = call("vanilla", lp, old, A, m, loss_agg_mode="token-mean", clip_ratio_low=0.1,
                                               clip_ratio_high=0.2, clip_ratio_c=3.0)
    expect = (3.0 + math.exp(0.1) + -1.2 + 0.9) / 4
    assert close(loss, expect, 1e-12)
    # clipped (l2 > l1): tokens 2 and 3 -> 0.5 ; dual clip: token 0 -> 0.25 ; ppo_kl = mean(-delta) = -(3.1)/4
    assert close(metrics["actor/pg_clipfrac"], 2 / (4 + 1e-8), 1e-6)
    assert close(metrics["actor/pg_clipfrac_lower"], 1 / (4 + 1e-8), 1e-6)
    assert close(metrics["actor/ppo_kl"], -3.1 / (4 + 1e-8), 1e-6)


def test_vanilla_defaults_are_0_2_and_3():
    LP, OLD, ADV, M = batch(4, spread=1.5)
    loss, _ = call("vanilla", t(LP), t(OLD), t(ADV), t(M))
    e_loss, _ = ref.vanilla(LP, OLD, ADV, M, "token-mean", 0.2, 0.2, 3.0)
    assert close(loss, e_loss)


# ----------------------------------------------------------------------------- gradients vs own autograd


def own_vanilla(lp, OLD, ADV, M, mode, lo, hi, c):
    """Per-token scalar graph written from the spec (float64), aggregated by the spec formulas."""
    B, L = len(M), len(M[0])
    rows = []
    for i in range(B):
        row = []
        for j in range(L):
            A = ADV[i][j]
            delta = torch.clamp(lp[i, j] - OLD[i][j], -20.0, 20.0)
            ratio = torch.exp(delta)
            l1 = -A * ratio
            l2 = -A * torch.clamp(ratio, 1 - lo, 1 + hi)
            lc = l1 if l1.item() >= l2.item() else l2
            if A < 0 and lc.item() > -A * c:
                lc = lc * 0 + (-A * c)
            row.append(lc)
        rows.append(row)
    return own_agg(rows, M, mode)


def own_agg(rows, M, mode):
    S = sum(1 for r in M if sum(r) > 0)
    T = sum(ref.flat(M))
    total = 0.0
    for row, m in zip(rows, M):
        srow = sum(l * mm for l, mm in zip(row, m))
        if mode == "seq-mean-token-mean":
            total = total + srow / (sum(m) + 1e-8)
        else:
            total = total + srow
    if mode == "token-mean":
        return total / T
    if mode == "token-sum":
        return total
    if mode == "seq-mean-token-sum-norm":
        return total / (S * C)
    return total / S


def own_gspo(lp, OLD, ADV, M, lo, hi):
    rows = []
    for i in range(len(M)):
        n = sum(M[i])
        lr = sum((lp[i, j] - OLD[i][j]) * M[i][j] for j in range(len(M[i]))) / max(n, 1)
        row = []
        for j in range(len(M[i])):
            A = ADV[i][j]
            log_s = lp[i, j] - lp[i, j].detach() + lr.detach()
            s = torch.exp(torch.clamp(log_s, max=10.0))
            l1 = -A * s
            l2 = -A * torch.clamp(s, 1 - lo, 1 + hi)
            row.append(l1 if l1.item() >= l2.item() else l2)
        rows.append(row)
    return own_agg(rows, M, "seq-mean-token-mean")


def own_cispo(lp, OLD, ADV, M, mode, lo, hi):
    rows = []
    for i in range(len(M)):
        row = []
        for j in range(len(M[i])):
            ratio = torch.exp(torch.clamp(lp[i, j] - OLD[i][j], -20.0, 20.0))
            w = torch.clamp(ratio, 1 - lo, 1 + hi).detach()
            row.append(-w * ADV[i][j] * lp[i, j])
        rows.append(row)
    return own_agg(rows, M, mode)


def own_gpg(lp, ADV, M, mode):
    return own_agg([[-lp[i, j] * ADV[i][j] for j in range(len(M[i]))] for i in range(len(M))], M, mode)


def grads(fn, LP):
    lp = t(LP).requires_grad_(True)
    out = fn(lp)
    (g,) = torch.autograd.grad(out, lp)
    return out.detach(), g


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
@pytest.mark.parametrize("layout", ref.LAYOUTS)
def test_vanilla_gradient(seed, mode, layout):
    LP, OLD, ADV, M = batch(100 + seed, spread=1.5, layout=layout)
    lo, hi, c = 0.2, 0.28, 3.0
    v1, g1 = grads(lambda lp: call("vanilla", lp, t(OLD), t(ADV), t(M), loss_agg_mode=mode,
                                                         clip_ratio_low=lo, clip_ratio_high=hi, clip_ratio_c=c,
                                                         const=C)[0], LP)
    v2, g2 = grads(lambda lp: own_vanilla(lp, OLD, ADV, M, mode, lo, hi, c), LP)
    assert close(v1, float(v2))
    assert torch.allclose(g1, g2, atol=1e-10, rtol=0)


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("per_seq", [True, False])
@pytest.mark.parametrize("layout", ref.LAYOUTS)
def test_gspo_value_and_gradient(seed, per_seq, layout):
    LP, OLD, ADV, M = batch(200 + seed, spread=0.5, adv_per_seq=per_seq, layout=layout)
    lo, hi = 0.2, 0.28
    fn = get_policy_loss("gspo")
    v1, g1 = grads(lambda lp: call(fn, lp, t(OLD), t(ADV), t(M), clip_ratio_low=lo, clip_ratio_high=hi)[0], LP)
    v2, g2 = grads(lambda lp: own_gspo(lp, OLD, ADV, M, lo, hi), LP)
    assert close(v1, ref.gspo(LP, OLD, ADV, M, lo, hi))
    assert close(v1, float(v2))
    assert torch.allclose(g1, g2, atol=1e-10, rtol=0)
    assert g1.abs().sum() > 0


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_gspo_is_always_seq_mean_token_mean(mode):
    LP, OLD, ADV, M = batch(7)
    loss, metrics = call("gspo", t(LP), t(OLD), t(ADV), t(M), loss_agg_mode=mode, const=C)
    assert close(loss, ref.gspo(LP, OLD, ADV, M))
    kl = [o - lp for o, lp in zip(ref.flat(OLD), ref.flat(LP))]
    assert close(metrics["actor/ppo_kl"], ref.masked_mean(kl, ref.flat(M)), 1e-6)
    for key in ("actor/pg_clipfrac", "actor/pg_clipfrac_lower"):
        assert torch.isfinite(torch.as_tensor(metrics[key]))


def test_gspo_hand():
    # one sequence of 2 tokens, log-ratios 0.1 and 0.3 -> lr = 0.2, s = e^0.2 = 1.2214 > 1.2 -> clipped for A=1
    lp = t([[0.1, 0.3, 5.0]])
    old = t([[0.0, 0.0, 0.0]])
    m = t([[1.0, 1.0, 0.0]])
    loss, _ = call("gspo", lp, old, t([[1.0, 1.0, 1.0]]), m)
    assert close(loss, -1.2 * 2 / (2 + 1e-8), 1e-12)
    loss, _ = call("gspo", lp, old, t([[-1.0, -1.0, -1.0]]), m)
    assert close(loss, math.exp(0.2) * 2 / (2 + 1e-8), 1e-12)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
@pytest.mark.parametrize("layout", ref.LAYOUTS)
def test_cispo_value_and_gradient(seed, mode, layout):
    LP, OLD, ADV, M = batch(300 + seed, spread=1.0, layout=layout)
    lo, hi = 0.2, 0.28
    fn = get_policy_loss("cispo")
    v1, g1 = grads(lambda lp: call(fn, lp, t(OLD), t(ADV), t(M), loss_agg_mode=mode, clip_ratio_low=lo,
                                 clip_ratio_high=hi, const=C)[0], LP)
    v2, g2 = grads(lambda lp: own_cispo(lp, OLD, ADV, M, mode, lo, hi), LP)
    assert close(v1, ref.cispo(LP, OLD, ADV, M, mode, lo, hi, C))
    assert close(v1, float(v2))
    assert torch.allclose(g1, g2, atol=1e-10, rtol=0)
    # every valid token keeps a gradient (the clipped ratio is only a weight)
    mt = t(M).bool()
    assert (g1[mt] != 0).all()


def test_cispo_metrics():
    LP, OLD, ADV, M = batch(9, spread=1.0)
    _, metrics = call("cispo", t(LP), t(OLD), t(ADV), t(M), clip_ratio_low=0.2, clip_ratio_high=0.28)
    ms = ref.flat(M)
    kl = [-(lp - o) for lp, o in zip(ref.flat(LP), ref.flat(OLD))]
    outside = [1.0 if not (0.8 <= math.exp(lp - o) <= 1.28) else 0.0 for lp, o in zip(ref.flat(LP), ref.flat(OLD))]
    assert close(metrics["actor/ppo_kl"], ref.masked_mean(kl, ms), 1e-6)
    assert close(metrics["actor/pg_clipfrac"], ref.masked_mean(outside, ms), 1e-6)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
@pytest.mark.parametrize("layout", ref.LAYOUTS)
def test_gpg_loss(seed, mode, layout):
    LP, OLD, ADV, M = batch(400 + seed, layout=layout)
    fn = get_policy_loss("gpg")
    v1, g1 = grads(lambda lp: call(fn, lp, t(OLD), t(ADV), t(M), loss_agg_mode=mode, const=C)[0], LP)
    v2, g2 = grads(lambda lp: own_gpg(lp, ADV, M, mode), LP)
    assert close(v1, ref.gpg_loss(LP, ADV, M, mode, C))
    assert torch.allclose(g1, g2, atol=1e-10, rtol=0)
    _, metrics = call(fn, t(LP), t(OLD), t(ADV), t(M))
    kl = [o - lp for o, lp in zip(ref.flat(OLD), ref.flat(LP))]
    assert close(metrics["actor/ppo_kl"], ref.masked_mean(kl, ref.flat(M)), 1e-6)
    assert float(metrics["actor/pg_clipfrac"]) == 0.0 == float(metrics["actor/pg_clipfrac_lower"])


# ----------------------------------------------------------------------------- huge log-ratios


@pytest.mark.parametrize("name", ["vanilla", "gpg", "gspo", "cispo"])
@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_huge_log_ratio_is_finite(name, mode):
    old = t([[0.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    lp0 = t([[1e4, -1e4, 1e4, -1e4], [1e4, 1e4, 0.5, -1e4]])
    A = t([[1.0, 1.0, -1.0, -1.0], [-2.0, -2.0, -2.0, -2.0]])
    m = t([[1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 1.0, 0.0]])
    lp = lp0.clone().requires_grad_(True)
    loss, metrics = call(name, lp, old, A, m, loss_agg_mode=mode, const=C)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(lp.grad).all()
    for v in metrics.values():
        assert torch.isfinite(torch.as_tensor(v)).all()
    LP, OLD, ADV, M = lp0.tolist(), old.tolist(), A.tolist(), m.tolist()
    if name == "vanilla":
        assert close(loss, ref.vanilla(LP, OLD, ADV, M, mode, C=C)[0])
    elif name == "gspo":
        assert close(loss, ref.gspo(LP, OLD, ADV, M))
    elif name == "cispo":
        assert close(loss, ref.cispo(LP, OLD, ADV, M, mode, C=C))


# ----------------------------------------------------------------------------- value loss


@pytest.mark.parametrize("layout", ref.LAYOUTS)
@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
@pytest.mark.parametrize("clip", [0.5, 0.2])
def test_value_loss(seed, mode, clip, layout):
    rng = random.Random(600 + seed)
    B, L = rng.randint(2, 7), rng.randint(2, 9)
    M = ref.layout_mask(rng, B, L, layout)
    L = len(M[0])
    VOLD = [[rng.uniform(-1, 1) for _ in range(L)] for _ in range(B)]
    VP = [[v + rng.uniform(-1, 1) for v in row] for row in VOLD]
    RET = [[rng.uniform(-2, 2) for _ in range(L)] for _ in range(B)]
    loss, metrics = value_loss(t(VP), t(VOLD), t(RET), t(M), cliprange_value=clip, loss_agg_mode=mode, const=C)
    e_loss, e_frac = ref.value_loss(VP, VOLD, RET, M, clip, mode, C)
    assert close(loss, e_loss)
    assert close(metrics["critic/vf_clipfrac"], e_frac, 1e-6)


def test_value_loss_hand():
    # v=2, v_old=0, R=0: v_clip=0.5 -> max(4, 0.25)=4 ; v=2, v_old=0, R=3: v_clip=0.5 -> max(1, 6.25) = 6.25 (clipped)
    loss, metrics = value_loss(t([[2.0, 2.0]]), t([[0.0, 0.0]]), t([[0.0, 3.0]]), t([[1.0, 1.0]]))
    assert close(loss, 0.5 * (4 + 6.25) / 2, 1e-12)
    assert close(metrics["critic/vf_clipfrac"], 1 / (2 + 1e-8), 1e-6)


def test_policy_loss_registry_names():
    for name in ("vanilla", "gpg", "gspo", "cispo"):
        assert name in POLICY_LOSSES
    with pytest.raises(KeyError, match="Did you mean 'vanilla'"):
        get_policy_loss("vanila")


# ----------------------------------------------------------------------------- the decoupled objective (async RL)


def stale_batch(seed, layout, drift=0.8):
    """LP, proximal (the trainer's old) and behaviour (the sampler's) log-probs, advantages, mask: the behaviour
    policy drifts from the proximal by up to `drift` in log space, so caps of 2 and 1.3 bind on some tokens."""
    LP, PROX, ADV, M = batch(seed, spread=0.6, layout=layout)
    rng = random.Random(9000 + seed)
    BEHAV = [[p + rng.uniform(-drift, drift) for p in row] for row in PROX]
    return LP, PROX, BEHAV, ADV, M


def decoupled(lp, PROX, BEHAV, ADV, M, mode, level, cap, cap_mode, normalize=False, loss="vanilla"):
    """What the trainer composes: behaviour weights (rollout correction) times the configured policy loss."""
    w, _ = rollout_is_weights(t(PROX), t(BEHAV), t(M), level=level, threshold=cap, batch_normalize=normalize,
                              mode=cap_mode)
    return call(loss, lp, t(PROX), t(ADV), t(M), rollout_is_weights=w, loss_agg_mode=mode, const=C)[0]


CAPS = [("token", 2.0, "truncate"), ("token", 1.3, "mask"), ("token", math.inf, "truncate"),
        ("sequence", 2.0, "mask"), ("sequence", 1.5, "truncate")]


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
@pytest.mark.parametrize("cap", CAPS)
@pytest.mark.parametrize("layout", ref.LAYOUTS)
def test_decoupled_objective_value_and_gradient(seed, mode, cap, layout):
    """PPO's clip against the proximal policy times the capped behaviour weight pi_prox / pi_behav is decoupled
    PPO: its value and its gradient in the current log-probs, written out per token (float64, plain loops)."""
    LP, PROX, BEHAV, ADV, M = stale_batch(seed, layout)
    level, threshold, cap_mode = cap
    e_loss, e_grad = ref.decoupled_ppo(LP, PROX, BEHAV, ADV, M, mode, level, threshold, cap_mode, C=C)
    lp = t(LP).requires_grad_(True)
    loss = decoupled(lp, PROX, BEHAV, ADV, M, mode, level, threshold, cap_mode)
    (grad,) = torch.autograd.grad(loss, lp)
    assert close(loss, e_loss)
    assert torch.allclose(grad, t(e_grad), atol=1e-12, rtol=1e-10)


def test_decoupled_objective_hand():
    """Ratio 1 to the proximal policy, behaviour weights e^0, e^1, e^-0.5: a cap of 2 truncates the middle one to
    2, or masks it (weight 0, still counted by token-mean's denominator, as AReaL's behav_imp_weight_cap)."""
    prox, behav = [[0.0, 0.0, 0.0]], [[0.0, -1.0, 0.5]]
    A, m = [[1.0, 2.0, 3.0]], [[1.0, 1.0, 1.0]]
    lp = t(prox)
    truncated = decoupled(lp, prox, behav, A, m, "token-mean", "token", 2.0, "truncate")
    masked = decoupled(lp, prox, behav, A, m, "token-mean", "token", 2.0, "mask")
    assert close(truncated, -(1 * 1 + 2 * 2 + 3 * math.exp(-0.5)) / 3, 1e-12)
    assert close(masked, -(1 * 1 + 0 + 3 * math.exp(-0.5)) / 3, 1e-12)


# ----------------------------------------------------------------------------- rejection sampling (rollout_rs)


RS = [("token_k1", "0.6_1.6", [("token_k1", 0.6, 1.6)]),
      ("token_k1,seq_max_k2", "0.6_1.6,0.15", [("token_k1", 0.6, 1.6), ("seq_max_k2", None, 0.15)]),
      ("seq_sum_k1", "0.5_2.0", [("seq_sum_k1", 0.5, 2.0)]),
      ("seq_mean_k1", 1.1, [("seq_mean_k1", 1 / 1.1, 1.1)]),
      ("seq_mean_k3", 0.06, [("seq_mean_k3", None, 0.06)]),
      ("token_k2,seq_sum_k3", 0.05, [("token_k2", None, 0.05), ("seq_sum_k3", None, 0.05)]),
      ("token_k3,seq_max_k3", "0.1,0.3", [("token_k3", None, 0.1), ("seq_max_k3", None, 0.3)])]


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("rs", RS, ids=[r[0] for r in RS])
@pytest.mark.parametrize("layout", ref.LAYOUTS)
def test_rejection_sampling_keeps_what_the_written_out_rule_keeps(seed, rs, layout):
    """rollout_rs masks a token (token_*) or a whole response (seq_*) whose divergence k1 / k2 / k3 between old and
    rollout log-probs is out of bounds, every listed option having to keep it; the thresholds as verl reads them (a
    k1 number u is the range 1/u to u). Float64 plain loops, on batches where some tokens are kept and some not."""
    from posttrain.algo.rollout_correction import rollout_rejection_mask

    options, threshold, specs = rs
    _, PROX, BEHAV, _, M = stale_batch(seed, layout)
    keep, metrics = rollout_rejection_mask(t(PROX), t(BEHAV), t(M), options=options, threshold=threshold)
    expected = ref.rollout_rejection_keep(PROX, BEHAV, M, specs)
    assert torch.equal(keep, t(expected))
    n = sum(map(sum, M))
    assert close(metrics["rollout_corr/rollout_rs_masked_fraction"], (n - sum(map(sum, expected))) / n, 1e-8)  # (mean: + 1e-8 in the denominator)


def test_rejection_sampling_binds_in_the_parametrised_batches():
    """The batches above both keep and reject tokens for every option set (else the comparison proves little)."""
    from posttrain.algo.rollout_correction import rollout_rejection_mask

    for options, threshold, _ in RS:
        fractions = []
        for seed in range(3):
            _, PROX, BEHAV, _, M = stale_batch(seed, "holes")
            _, metrics = rollout_rejection_mask(t(PROX), t(BEHAV), t(M), options=options, threshold=threshold)
            fractions.append(metrics["rollout_corr/rollout_rs_masked_fraction"])
        assert 0 < max(fractions) and min(fractions) < 1, (options, fractions)


def test_rejection_sampling_hand():
    """log(old / rollout) = 0, 1, -0.4 on one response: token_k1 (k1 = 0, -1, 0.4) in [log 0.6, log 1.6] keeps the
    first and last tokens; seq_max_k2 (max d^2 / 2 = 0.5) keeps the response at 2.5 and rejects it at 0.4, with
    verl's metric names."""
    from posttrain.algo.rollout_correction import rollout_rejection_mask

    old, roll, m = t([[0.0, 0.0, 0.0, 0.0]]), t([[0.0, -1.0, 0.4, 0.0]]), t([[1.0, 1.0, 1.0, 0.0]])
    keep, metrics = rollout_rejection_mask(old, roll, m, options="token_k1,seq_max_k2", threshold="0.6_1.6,2.5")
    assert keep.tolist() == [[1.0, 0.0, 1.0, 0.0]]
    assert close(metrics["rollout_corr/rollout_rs_token_k1_masked_fraction"], 1 / 3, 1e-8)
    assert close(metrics["rollout_corr/rollout_rs_token_k1_fraction_low"], 1 / 3, 1e-8)  # k1 = -1 < log 0.6
    assert close(metrics["rollout_corr/rollout_rs_seq_max_k2_max"], 0.5, 1e-12)
    assert metrics["rollout_corr/rollout_rs_seq_masked_fraction"] == 1.0
    keep, metrics = rollout_rejection_mask(old, roll, m, options="token_k1,seq_max_k2", threshold="0.6_1.6,0.4")
    assert keep.tolist() == [[0.0, 0.0, 0.0, 0.0]]
    assert close(metrics["rollout_corr/rollout_rs_masked_fraction"], 1.0, 1e-8)


@pytest.mark.parametrize("name", sorted(POLICY_LOSSES.names()))
@pytest.mark.parametrize("cap", CAPS)
@pytest.mark.parametrize("layout", ref.LAYOUTS)
def test_zero_staleness_is_the_synchronous_loss_exactly(name, cap, layout):
    """Behaviour = proximal (no staleness, same numerics): every weight is exactly 1, so each policy loss and its
    gradient equal the loss without rollout correction bit for bit (batch normalisation left out: at token level
    it divides by masked_mean's sum / (T + 1e-8), 1 only to within 1e-8 / T)."""
    LP, PROX, _, ADV, M = stale_batch(3, layout)
    level, threshold, cap_mode = cap
    lp_a, lp_b = t(LP).requires_grad_(True), t(LP).requires_grad_(True)
    torch.manual_seed(0)  # clip_cov draws its dropped tokens
    plain = call(name, lp_a, t(PROX), t(ADV), t(M), loss_agg_mode="token-mean", const=C)[0]
    torch.manual_seed(0)
    weighted = decoupled(lp_b, PROX, PROX, ADV, M, "token-mean", level, threshold, cap_mode, loss=name)
    assert torch.equal(plain, weighted)
    assert torch.equal(torch.autograd.grad(plain, lp_a)[0], torch.autograd.grad(weighted, lp_b)[0])
