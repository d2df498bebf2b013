"""loss_agg_mode formulas, and the micro-batch invariance of every policy loss and the value loss (ALGORITHMS.md,
"Loss aggregation": the loss of a mini-batch must not depend on how it is split into micro-batches or ranks)."""

import random

import pytest
import torch
import torch.nn.functional as F

import algo_reference as ref
from algo_reference import single_torch_thread  # noqa: F401  (autouse fixture)
from posttrain.algo import LOSS_AGG_MODES, AggNorm, agg_loss, agg_norm, LossSettings, get_policy_loss, value_loss

F64 = torch.float64
C = 11.0


def call(loss, lp, old, A, m, norm=None, rollout_is_weights=None, **settings):
    """A policy loss by name (or function), with the actor's calling convention; keywords become LossSettings."""
    fn = get_policy_loss(loss) if isinstance(loss, str) else loss
    return fn(lp, old, A, m, settings=LossSettings(**settings), norm=norm, rollout_is_weights=rollout_is_weights)


def t(x, dtype=F64):
    return torch.tensor(x, dtype=dtype)


def rand_case(seed, B=None, L=None, layout="holes"):
    rng = random.Random(seed)
    B = B or rng.randint(2, 8)
    L = L or rng.randint(2, 9)
    M = ref.layout_mask(rng, B, L, layout)
    L = len(M[0])
    LM = [[rng.uniform(-3, 3) for _ in range(L)] for _ in range(B)]
    return LM, M


# ----------------------------------------------------------------------------- the four formulas


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
@pytest.mark.parametrize("layout", ref.LAYOUTS)
def test_agg_formulas(seed, mode, layout):
    LM, M = rand_case(seed, layout=layout)
    got = agg_loss(t(LM), t(M), mode, const=C)
    exp = ref.agg(LM, M, mode, C)
    assert abs(got.item() - exp) <= 1e-12 * max(1, abs(exp))
    # the same with the explicit normaliser of this batch, and with a bool mask
    assert abs(agg_loss(t(LM), t(M), mode, norm=agg_norm(t(M), C)).item() - exp) <= 1e-12 * max(1, abs(exp))
    assert abs(agg_loss(t(LM), t(M, torch.bool), mode, const=C).item() - exp) <= 1e-12 * max(1, abs(exp))


def test_agg_hand():
    LM = [[1.0, 2.0, 3.0], [4.0, 9.0, 9.0], [7.0, 7.0, 7.0]]
    M = [[1, 1, 1], [1, 0, 0], [0, 0, 0]]
    m = t(M)
    assert abs(agg_loss(t(LM), m, "token-mean").item() - 10 / 4) < 1e-12
    assert abs(agg_loss(t(LM), m, "seq-mean-token-sum").item() - 10 / 2) < 1e-12
    assert abs(agg_loss(t(LM), m, "seq-mean-token-mean").item() - (6 / (3 + 1e-8) + 4 / (1 + 1e-8)) / 2) < 1e-12
    assert abs(agg_loss(t(LM), m, "seq-mean-token-sum-norm", const=5.0).item() - 10 / (2 * 5)) < 1e-12


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("layout", ref.LAYOUTS)
def test_padding_wider_changes_nothing(mode, seed, layout):
    """seq-mean-token-sum-norm divides by the constant C, never by the padded length of the current batch."""
    LM, M = rand_case(seed + 50, layout=layout)
    base = agg_loss(t(LM), t(M), mode, const=C).item()
    rng = random.Random(seed)
    extra = rng.randint(1, 20)
    LM2 = [row + [rng.uniform(-50, 50) for _ in range(extra)] for row in LM]
    M2 = [row + [0.0] * extra for row in M]
    wide = agg_loss(t(LM2), t(M2), mode, const=C).item()
    assert abs(wide - base) <= 1e-12 * max(1, abs(base))
    if mode == "seq-mean-token-sum-norm":
        S = sum(1 for r in M if sum(r) > 0)
        total = sum(l * m for l, m in zip(ref.flat(LM), ref.flat(M)))
        assert abs(base - total / (S * C)) <= 1e-12 * max(1, abs(base))
        assert len(M[0]) != C and len(M2[0]) != C


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_all_masked_minibatch_is_zero(mode):
    x = t([[1.0, -2.0, 3.0], [4.0, 5.0, 6.0]]).requires_grad_(True)
    m = torch.zeros(2, 3, dtype=F64)
    out = agg_loss(x, m, mode, const=C)
    out.backward()
    assert out.item() == 0.0 and torch.isfinite(x.grad).all() and torch.equal(x.grad, torch.zeros_like(x))
    out = agg_loss(x.detach(), m, mode, norm=agg_norm(m, C))
    assert out.item() == 0.0
    assert agg_norm(m, C) == AggNorm(0.0, 0.0, C)


def test_unknown_mode_and_missing_constant_raise():
    x, m = torch.ones(2, 3, dtype=F64), torch.ones(2, 3, dtype=F64)
    with pytest.raises(ValueError, match="token-mean"):
        agg_loss(x, m, "token-meen")
    with pytest.raises(ValueError):
        agg_loss(x, m, "seq-mean-token-sum-norm")  # no C: it must not fall back to the padded length
    with pytest.raises(ValueError):
        agg_loss(x, m, "seq-mean-token-sum-norm", const=0.0)
    # C may come from the normaliser or from const
    assert agg_loss(x, m, "seq-mean-token-sum-norm", norm=agg_norm(m), const=4.0).item() == 6 / (2 * 4)
    assert agg_loss(x, m, "seq-mean-token-sum-norm", norm=agg_norm(m, 3.0)).item() == 6 / (2 * 3)


def test_agg_norm_counts_and_sums_over_micro_batches():
    M = [[1, 1, 0], [0, 0, 0], [1, 0, 1], [0, 1, 0]]
    n = agg_norm(t(M), 7.0)
    assert (n.tokens, n.seqs, n.const) == (5.0, 3.0, 7.0)
    parts = agg_norm(t(M[:1]), 7.0) + agg_norm(t(M[1:2]), 7.0) + agg_norm(t(M[2:]), 7.0)
    assert parts == n


# ----------------------------------------------------------------------------- micro-batch invariance


def splits(rng, B, dead_rows):
    """Random partitions of range(B): contiguous, shuffled uneven, singletons, and one holding only masked rows."""
    out = [[list(range(B))]]
    for _ in range(3):
        idx = list(range(B))
        rng.shuffle(idx)
        cuts = sorted(rng.sample(range(1, B), rng.randint(1, B - 1)))
        parts, prev = [], 0
        for c in cuts + [B]:
            parts.append(idx[prev:c])
            prev = c
        out.append(parts)
    out.append([[i] for i in range(B)])
    live = [i for i in range(B) if i not in dead_rows]
    rng.shuffle(live)
    half = len(live) // 2
    out.append([live[:half], list(dead_rows), live[half:]])
    return [[p for p in parts if p] for parts in out]


class Model:
    """log_prob / value as a function of a small shared parameter set, so every micro-batch touches it."""

    def __init__(self, seed, B, L):
        g = torch.Generator().manual_seed(seed)
        self.X = torch.randn(B, L, generator=g, dtype=F64)
        self.Y = torch.randn(B, L, generator=g, dtype=F64)
        self.noise = 0.5 * torch.randn(B, L, generator=g, dtype=F64)
        self.adv = torch.randn(B, L, generator=g, dtype=F64)
        self.seq_adv = torch.randn(B, 1, generator=g, dtype=F64).expand(B, L).clone()
        self.returns = torch.randn(B, L, generator=g, dtype=F64)
        self.theta = torch.tensor([0.7, -0.3], dtype=F64, requires_grad=True)
        self.w = (0.1 * torch.randn(L, generator=g, dtype=F64)).requires_grad_(True)

    def params(self):
        return [self.theta, self.w]

    def out(self, rows):
        z = self.X[rows] * self.theta[0] + self.Y[rows] * self.theta[1] + self.w
        return F.logsigmoid(z), z  # log-probs, values


def accumulate(model, rows_list, fn):
    for p in model.params():
        p.grad = None
    total = 0.0
    for rows in rows_list:
        loss = fn(rows)
        loss.backward()
        total += loss.item()
    return total, [p.grad.clone() for p in model.params()]


def invariance_case(seed, layout="holes"):
    rng = random.Random(seed)
    B, L = rng.randint(6, 10), rng.randint(3, 8)
    M = ref.layout_mask(rng, B, L, layout, zero_rows=False)
    L = len(M[0])
    dead = rng.sample(range(B), 2)
    for i in dead:
        M[i] = [0.0] * L
    return rng, B, L, t(M), dead


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
@pytest.mark.parametrize("name", ["vanilla", "gpg", "gspo", "cispo", "sapo", "geo_mean", "dppo_tv", "dppo_kl"])
@pytest.mark.parametrize("layout", ref.LAYOUTS)
def test_policy_loss_micro_batch_invariance(name, mode, seed, layout):
    """clip_cov / kl_cov are not here: their token selection is per call (micro-batch), as in verl."""
    rng, B, L, mask, dead = invariance_case(1000 * seed + 7, layout=layout)
    model = Model(seed, B, L)
    old = (model.out(list(range(B)))[0] + model.noise).detach()
    adv = model.seq_adv if name in ("gspo", "geo_mean") else model.adv
    loss_fn = get_policy_loss(name)
    full_norm = agg_norm(mask, C)

    def one_pass(rows):
        lp, _ = model.out(rows)
        return call(loss_fn, lp, old[rows], adv[rows], mask[rows], loss_agg_mode=mode, clip_ratio_low=0.2,
                       clip_ratio_high=0.28, clip_ratio_c=3.0, const=C)[0]

    def micro(rows):
        lp, _ = model.out(rows)
        return call(loss_fn, lp, old[rows], adv[rows], mask[rows], loss_agg_mode=mode, clip_ratio_low=0.2,
                       clip_ratio_high=0.28, clip_ratio_c=3.0, norm=full_norm, const=C)[0]

    full_loss, full_grads = accumulate(model, [list(range(B))], one_pass)
    assert any(g.abs().sum() > 0 for g in full_grads)
    for parts in splits(rng, B, dead):
        loss, grads = accumulate(model, parts, micro)
        assert abs(loss - full_loss) <= 1e-10, parts
        for g, fg in zip(grads, full_grads):
            assert torch.allclose(g, fg, atol=1e-10, rtol=0), parts


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
@pytest.mark.parametrize("layout", ref.LAYOUTS)
def test_value_loss_micro_batch_invariance(mode, seed, layout):
    rng, B, L, mask, dead = invariance_case(99 + seed, layout=layout)
    model = Model(seed + 10, B, L)
    old_v = (model.out(list(range(B)))[1] + model.noise).detach()
    full_norm = agg_norm(mask, C)

    def run(rows, norm):
        _, v = model.out(rows)
        return value_loss(v, old_v[rows], model.returns[rows], mask[rows], cliprange_value=0.2, loss_agg_mode=mode,
                          norm=norm, const=C)[0]

    full_loss, full_grads = accumulate(model, [list(range(B))], lambda rows: run(rows, None))
    for parts in splits(rng, B, dead):
        loss, grads = accumulate(model, parts, lambda rows: run(rows, full_norm))
        assert abs(loss - full_loss) <= 1e-10
        for g, fg in zip(grads, full_grads):
            assert torch.allclose(g, fg, atol=1e-10, rtol=0)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_ranks_sum_their_normalisers(mode):
    """Two 'ranks', each with two micro-batches: normaliser = sum of every part's agg_norm."""
    rng, B, L, mask, dead = invariance_case(5)
    LM = torch.randn(B, L, dtype=F64, generator=torch.Generator().manual_seed(3))
    parts = splits(rng, B, dead)[1]
    norm = agg_norm(mask[parts[0]], C)
    for p in parts[1:]:
        norm = norm + agg_norm(mask[p], C)
    total = sum(agg_loss(LM[p], mask[p], mode, norm=norm).item() for p in parts)
    assert abs(total - ref.agg(LM.tolist(), mask.tolist(), mode, C)) < 1e-10
