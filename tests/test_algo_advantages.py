"""Advantage estimators against independent float64 re-derivations of ALGORITHMS.md (tests/algo_reference.py)."""

import math
import random

import pytest
import torch

import algo_reference as ref
from algo_reference import single_torch_thread  # noqa: F401  (autouse fixture)
from posttrain.algo import compute_advantage, estimator_info

F64 = torch.float64
ATOL = 1e-9

OUTCOME = ["grpo", "grpo_drgrpo", "rloo", "gpg", "opo", "grpo_passk", "reinforce_plus_plus_baseline"]
ALL = ["gae", "grpo", "grpo_drgrpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "remax",
       "gpg", "opo", "grpo_passk"]


def t(x, dtype=F64):
    return torch.tensor(x, dtype=dtype)


def assert_close(actual, expected, mask=None, atol=ATOL):
    """actual: tensor (B, L); expected: nested lists. Compare where mask=1 (everywhere when mask is None)."""
    a = actual.detach().to(F64).tolist()
    assert torch.isfinite(actual).all()
    for i, row in enumerate(expected):
        for j, e in enumerate(row):
            if mask is not None and not mask[i][j]:
                continue
            assert abs(a[i][j] - e) <= atol * max(1.0, abs(e)), (i, j, a[i][j], e)


def run(name, R, M, uids=None, V=None, baselines=None, gamma=1.0, lam=1.0, mask_dtype=F64):
    kwargs = dict(token_level_rewards=t(R), response_mask=t(M, mask_dtype), index=uids, gamma=gamma, lam=lam)
    if V is not None:
        kwargs["values"] = t(V)
    if baselines is not None:
        kwargs["reward_baselines"] = t(baselines)
    if name == "grpo_drgrpo":
        return compute_advantage("grpo", norm_adv_by_std_in_grpo=False, **kwargs)
    return compute_advantage(name, **kwargs)


def expected_outcome(name, R, M, uids):
    if name == "grpo":
        return ref.grpo(R, uids)
    if name == "grpo_drgrpo":
        return ref.grpo(R, uids, norm_by_std=False)
    if name == "rloo":
        return ref.rloo(R, uids)
    if name == "gpg":
        return ref.gpg(R, uids)
    if name == "opo":
        return ref.opo(R, M, uids)
    if name == "grpo_passk":
        return ref.grpo_passk(R, uids)
    raise AssertionError(name)


# ----------------------------------------------------------------------------- random batches, every estimator


@pytest.mark.parametrize("layout", ref.LAYOUTS)
@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("name", ["grpo", "grpo_drgrpo", "rloo", "gpg", "opo", "grpo_passk"])
def test_outcome_estimators_random(name, seed, layout):
    rng = random.Random(1000 * seed + len(name))
    uids = ref.random_layout(rng, n_groups=rng.randint(2, 5), max_group=5, allow_single=name != "grpo_passk")
    B, L = len(uids), rng.randint(3, 9)
    M = ref.layout_mask(rng, B, L, layout)
    L = len(M[0])
    R = ref.outcome_rewards(rng, M, binary=seed % 2 == 0)
    adv, ret = run(name, R, M, uids)
    assert adv.shape == ret.shape == (B, L)
    expected = ref.broadcast(expected_outcome(name, R, M, uids), M)
    assert_close(adv, expected)  # exactly A_i * m everywhere, padding included
    assert_close(ret, expected)


@pytest.mark.parametrize("layout", ref.LAYOUTS)
@pytest.mark.parametrize("seed", range(6))
def test_reinforce_plus_plus_baseline_random(seed, layout):
    rng = random.Random(77 + seed)
    uids = ref.random_layout(rng, n_groups=rng.randint(2, 5), max_group=5)
    B, L = len(uids), rng.randint(3, 9)
    M = ref.layout_mask(rng, B, L, layout)
    L = len(M[0])
    R = ref.outcome_rewards(rng, M, binary=seed % 2 == 0)
    s = ref.scores(R)
    mu, _ = ref.group_mean_std(s, uids)
    if len({round(s[i] - mu[i], 12) for i in range(B) if sum(M[i])}) < 2:
        R[0][0] += 1.0  # make sure the pooled variance is not zero (a separate test covers that)
        M[0][0] = 1.0
    adv, ret = run("reinforce_plus_plus_baseline", R, M, uids)
    expected = ref.reinforce_pp_baseline(R, M, uids)
    assert_close(adv, expected)
    assert_close(ret, expected)
    # constant over the valid tokens of each response
    for i in range(B):
        vals = {round(v, 9) for v, m in zip(adv[i].tolist(), M[i]) if m}
        assert len(vals) <= 1


@pytest.mark.parametrize("layout", ref.LAYOUTS)
@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("gamma", [1.0, 0.9])
def test_reinforce_plus_plus_random(seed, gamma, layout):
    rng = random.Random(300 + seed)
    B, L = rng.randint(3, 7), rng.randint(3, 10)
    M = ref.layout_mask(rng, B, L, layout)
    L = len(M[0])
    R = [[rng.uniform(-1, 1) for _ in range(L)] for _ in range(B)]  # dense, also on masked positions
    adv, ret = run("reinforce_plus_plus", R, M, gamma=gamma)
    e_adv, e_ret = ref.reinforce_pp(R, M, gamma)
    assert_close(adv, e_adv)
    assert_close(ret, e_ret)


@pytest.mark.parametrize("layout", ref.LAYOUTS)
@pytest.mark.parametrize("seed", range(6))
def test_remax_random(seed, layout):
    rng = random.Random(500 + seed)
    B, L = rng.randint(2, 7), rng.randint(2, 10)
    M = ref.layout_mask(rng, B, L, layout)
    L = len(M[0])
    R = [[rng.uniform(-1, 1) for _ in range(L)] for _ in range(B)]
    b = [rng.uniform(-1, 1) for _ in range(B)]
    adv, ret = run("remax", R, M, baselines=b)
    e_adv, e_ret = ref.remax(R, M, b)
    assert_close(adv, e_adv)
    assert_close(ret, e_ret)


@pytest.mark.parametrize("layout", ref.LAYOUTS)
@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.99, 0.95), (0.7, 0.3)])
def test_gae_random(seed, gamma, lam, layout):
    rng = random.Random(900 + seed)
    B, L = rng.randint(2, 7), rng.randint(2, 10)
    M = ref.layout_mask(rng, B, L, layout)
    L = len(M[0])
    R = [[rng.uniform(-1, 1) for _ in range(L)] for _ in range(B)]
    V = [[rng.uniform(-1, 1) for _ in range(L)] for _ in range(B)]
    adv, ret = run("gae", R, M, V=V, gamma=gamma, lam=lam)
    A_raw, e_ret = ref.gae(R, M, V, gamma, lam)
    assert_close(adv, ref.masked_whiten(A_raw, M), mask=M)
    assert_close(ret, e_ret, mask=M)


@pytest.mark.parametrize("seed", range(4))
def test_gae_ignores_values_and_rewards_at_masked_positions(seed):
    rng = random.Random(40 + seed)
    B, L = 5, 9
    M = ref.random_mask(rng, B, L, zero_rows=False)
    M[0] = [1, 0, 0, 1, 1, 0, 1, 0, 0]  # holes and padding for sure
    R = [[rng.uniform(-1, 1) for _ in range(L)] for _ in range(B)]
    V = [[rng.uniform(-1, 1) for _ in range(L)] for _ in range(B)]
    adv1, ret1 = run("gae", R, M, V=V, gamma=0.9, lam=0.8)
    V2 = [[v if m else rng.uniform(-1e3, 1e3) for v, m in zip(vr, mr)] for vr, mr in zip(V, M)]
    R2 = [[r if m else rng.uniform(-1e3, 1e3) for r, m in zip(rr, mr)] for rr, mr in zip(R, M)]
    adv2, ret2 = run("gae", R2, M, V=V2, gamma=0.9, lam=0.8)
    mt = t(M).bool()
    assert torch.allclose(adv1[mt], adv2[mt], atol=1e-12, rtol=0)
    assert torch.allclose(ret1[mt], ret2[mt], atol=1e-12, rtol=0)


@pytest.mark.parametrize("mask_dtype", [torch.bool, torch.long, torch.float32])
@pytest.mark.parametrize("name", ALL)
def test_mask_dtypes(name, mask_dtype):
    rng = random.Random(7)
    uids = ["a", "b", "a", "c", "b", "c", "a"]
    B, L = len(uids), 6
    M = ref.random_mask(rng, B, L, zero_rows=False)
    R = ref.outcome_rewards(rng, M, binary=False)
    V = [[rng.uniform(-1, 1) for _ in range(L)] for _ in range(B)]
    b = [0.3] * B
    base_adv, base_ret = run(name, R, M, uids, V=V, baselines=b)
    adv, ret = run(name, R, M, uids, V=V, baselines=b, mask_dtype=mask_dtype)
    mt = t(M).bool()
    assert torch.allclose(adv[mt], base_adv[mt], atol=1e-12) and torch.allclose(ret[mt], base_ret[mt], atol=1e-12)


# ----------------------------------------------------------------------------- hand-computed cases


def one_group(scores_, uid="q"):
    """Outcome rewards on the last of 3 tokens, full masks, one group."""
    R = [[0.0, 0.0, s] for s in scores_]
    M = [[1.0, 1.0, 1.0] for _ in scores_]
    return R, M, [uid] * len(scores_)


def test_grpo_hand():
    R, M, uids = one_group([1, 0, 1, 0])
    adv, ret = run("grpo", R, M, uids)
    # mean 0.5, unbiased std sqrt(1/3) = 0.57735..., A = +-0.5 / (0.57735 + 1e-6) = +-0.86602390
    expect = [0.8660239, -0.8660239, 0.8660239, -0.8660239]
    assert torch.allclose(adv[:, 0], t(expect), atol=1e-7)
    assert abs(adv[0, 0].item() - 0.5 / (math.sqrt(1 / 3) + 1e-6)) < 1e-12
    assert torch.equal(adv, ret)


def test_drgrpo_hand():
    R, M, uids = one_group([1, 0, 1, 0])
    adv, _ = run("grpo_drgrpo", R, M, uids)
    assert torch.allclose(adv[:, 2], t([0.5, -0.5, 0.5, -0.5]), atol=1e-12)


def test_rloo_hand():
    R, M, uids = one_group([1, 0, 1, 0])
    adv, _ = run("rloo", R, M, uids)
    # 1 - (0+1+0)/3 = 2/3 ; 0 - (1+1+0)/3 = -2/3
    assert torch.allclose(adv[:, 1], t([2 / 3, -2 / 3, 2 / 3, -2 / 3]), atol=1e-12)
    # k=1: A = s
    adv1, _ = run("rloo", [[0.0, 0.0, 0.7]], [[1.0, 1.0, 1.0]], ["solo"])
    assert torch.allclose(adv1, t([[0.7, 0.7, 0.7]]), atol=1e-12)


def test_opo_hand():
    R = [[1.0, 0, 0, 0], [0, 0, 0, 0], [0, 0, 1.0, 0], [0, 0, 0, 0]]
    M = [[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1]]
    adv, _ = run("opo", R, M, ["g"] * 4)
    # lengths 1,2,3,4 ; b = (1*1 + 3*1) / 10 = 0.4
    expect = [[0.6, 0, 0, 0], [-0.4, -0.4, 0, 0], [0.6, 0.6, 0.6, 0], [-0.4, -0.4, -0.4, -0.4]]
    assert torch.allclose(adv, t(expect), atol=1e-12)


def test_gpg_hand_counts_zero_centred_not_zero_scores():
    # groups: x=[2,2] (centred 0,0), y=[0,0] (0,0), z=[1,0] (+-0.5). B=6, M=4 -> alpha = 6/2 = 3.
    # Counting non-zero *scores* instead (3 of them) would give alpha 2 -> +-1; the spec says +-1.5.
    uids = ["x", "z", "y", "x", "y", "z"]
    sc = [2, 1, 0, 2, 0, 0]
    R = [[0.0, float(s)] for s in sc]
    M = [[1.0, 1.0]] * 6
    adv, _ = run("gpg", R, M, uids)
    assert torch.allclose(adv[:, 0], t([0, 1.5, 0, 0, 0, -1.5]), atol=1e-12)


def test_gpg_no_zero_signal_alpha_one():
    R, M, uids = one_group([3, 1])
    adv, _ = run("gpg", R, M, uids)
    assert torch.allclose(adv[:, 0], t([1.0, -1.0]), atol=1e-12)


def test_gpg_all_zero_signal():
    R, M, uids = one_group([1, 1, 1])
    adv, _ = run("gpg", R, M, uids)  # B - M = 0 -> alpha = B / 1, times 0
    assert torch.equal(adv, torch.zeros_like(adv))


def test_grpo_passk_hand():
    R = [[0.0, 3.0], [0.0, 1.0], [0.0, 2.0], [0.0, 5.0], [0.0, 5.0], [0.0, 0.0]]
    M = [[1.0, 1.0]] * 6
    uids = ["a", "a", "a", "b", "b", "b"]
    adv, ret = run("grpo_passk", R, M, uids)
    # a: best 3, second 2, unbiased std of [3,1,2] = 1 -> 1/(1+1e-6) ; b: tie at the top -> gap 0
    expect = [1 / (1 + 1e-6), 0, 0, 0, 0, 0]
    assert torch.allclose(adv[:, 0], t(expect), atol=1e-12) and torch.equal(adv, ret)
    adv_raw, _ = compute_advantage("grpo_passk", token_level_rewards=t(R), response_mask=t(M), index=uids,
                                   norm_adv_by_std_in_grpo=False)
    assert torch.allclose(adv_raw[:, 1], t([1.0, 0, 0, 0, 0, 0]), atol=1e-12)


def test_grpo_passk_first_on_ties_gets_the_gap_slot():
    # two tied best (4, 4) and a lower one: the best slot goes to the first; gap to the second best is 0
    R = [[0.0, 1.0], [0.0, 4.0], [0.0, 4.0]]
    adv, _ = run("grpo_passk", R, [[1.0, 1.0]] * 3, ["p"] * 3)
    assert torch.equal(adv, torch.zeros_like(adv))


@pytest.mark.parametrize("uids", [["a", "b"], ["a", "a", "b"], ["solo"]])
def test_grpo_passk_needs_two_members(uids):
    R = [[0.0, 1.0]] * len(uids)
    with pytest.raises(ValueError):
        run("grpo_passk", R, [[1.0, 1.0]] * len(uids), uids)


def test_reinforce_plus_plus_hand():
    R = [[0.0, 0.0, 1.0], [0.0, 2.0, 0.0]]
    M = [[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]]
    adv, ret = run("reinforce_plus_plus", R, M, gamma=0.5)
    # row 0: G = [0.25, 0.5, 1]; row 1: G = [1, 2, 0]
    assert torch.allclose(ret, t([[0.25, 0.5, 1.0], [1.0, 2.0, 0.0]]), atol=1e-12)
    vals = [0.25, 0.5, 1.0, 1.0, 2.0]
    mean = sum(vals) / (5 + 1e-8)  # masked_mean
    exact = sum(vals) / 5
    var = sum((v - exact) ** 2 for v in vals) / 4  # unbiased
    w = [(v - mean) / math.sqrt(var + 1e-8) for v in vals]
    assert torch.allclose(adv, t([[w[0], w[1], w[2]], [w[3], w[4], 0.0]]), atol=1e-9)


def test_reinforce_plus_plus_return_passes_an_observation_span():
    # turn 1 (t=0,1), observation tokens (t=2,3: m=0), turn 2 (t=4,5) with the outcome reward on its last token:
    # the return reaches turn 1, discounted once per response token only; observation positions get G = 0
    R = [[0.0, 0.0, 0.0, 0.0, 0.0, 1.0]]
    M = [[1.0, 1.0, 0.0, 0.0, 1.0, 1.0]]
    _, ret = run("reinforce_plus_plus", R, M, gamma=0.5)
    assert torch.allclose(ret, t([[0.125, 0.25, 0.0, 0.0, 0.5, 1.0]]), atol=1e-12)
    adv, ret = run("reinforce_plus_plus", R, M, gamma=0.9)
    e_adv, e_ret = ref.reinforce_pp(R, M, 0.9)
    assert_close(adv, e_adv)
    assert_close(ret, e_ret)
    assert float(ret[0, 0]) > 0  # the earlier rule cut the return here (run reset at the observation span)
    assert ref.reinforce_pp_returns_old(R, M, 0.9)[0][0] == 0.0


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("gamma", [1.0, 0.9])
def test_reinforce_plus_plus_right_padded_same_as_before(seed, gamma):
    rng = random.Random(900 + seed)
    B, L = rng.randint(3, 7), rng.randint(3, 10)
    M = ref.random_mask(rng, B, L, holes=False)
    R = ref.outcome_rewards(rng, M, binary=False)
    _, ret = run("reinforce_plus_plus", R, M, gamma=gamma)
    assert_close(ret, ref.reinforce_pp_returns_old(R, M, gamma))


def test_remax_hand():
    adv, ret = run("remax", [[0.0, 1.0, 0.5]], [[1.0, 1.0, 0.0]], baselines=[0.3])
    assert torch.allclose(ret, t([[1.0, 1.0, 0.0]]), atol=1e-12)
    assert torch.allclose(adv, t([[0.7, 0.7, 0.0]]), atol=1e-12)


def test_gae_hand():
    # gamma 0.9, lam 0.8, V = 0.5, one reward of 1 at the end:
    # t=2: delta 0.5, A=0.5 ; t=1: delta 0.45-0.5=-0.05, A=-0.05+0.72*0.5=0.31 ; t=0: A=-0.05+0.72*0.31=0.1732
    _, ret = run("gae", [[0.0, 0.0, 1.0]], [[1.0, 1.0, 1.0]], V=[[0.5, 0.5, 0.5]], gamma=0.9, lam=0.8)
    assert torch.allclose(ret, t([[0.6732, 0.81, 1.0]]), atol=1e-12)
    # a hole at t=1 (value 9 there must be ignored): t=2: A=0.5 ; t=0: delta=0.45-0.5, A=-0.05+0.72*0.5=0.31
    _, ret = run("gae", [[0.0, 7.0, 1.0]], [[1.0, 0.0, 1.0]], V=[[0.5, 9.0, 0.5]], gamma=0.9, lam=0.8)
    assert abs(ret[0, 0].item() - 0.81) < 1e-12 and abs(ret[0, 2].item() - 1.0) < 1e-12


def test_gae_advantages_are_whitened_over_the_batch():
    R = [[0.0, 1.0], [0.0, 0.0]]
    M = [[1.0, 1.0], [1.0, 0.0]]
    V = [[0.0, 0.0], [0.0, 0.0]]
    adv, ret = run("gae", R, M, V=V)
    # A_raw = [[1,1],[0,-]] -> mean 2/3, unbiased var 1/3
    mean = 2 / (3 + 1e-8)  # masked_mean's 1e-8
    sd = math.sqrt(1 / 3 + 1e-8)
    assert abs(adv[0, 0].item() - (1 - mean) / sd) < 1e-9 and abs(adv[1, 0].item() - (0 - mean) / sd) < 1e-9


# ----------------------------------------------------------------------------- edge cases


@pytest.mark.parametrize("name", ["grpo", "grpo_drgrpo", "rloo", "gpg", "opo", "reinforce_plus_plus_baseline"])
def test_group_of_one(name):
    R = [[0.0, 0.8], [0.0, 1.0], [0.0, 0.0]]
    M = [[1.0, 1.0]] * 3
    uids = ["alone", "pair", "pair"]
    adv, _ = run(name, R, M, uids)
    if name == "reinforce_plus_plus_baseline":
        expected = ref.reinforce_pp_baseline(R, M, uids)
    else:
        expected = ref.broadcast(expected_outcome(name, R, M, uids), M)
    assert_close(adv, expected)
    if name == "grpo":  # mu=0, sigma=1
        assert abs(adv[0, 0].item() - 0.8 / (1 + 1e-6)) < 1e-12
    if name in ("rloo", "opo", "grpo_drgrpo"):  # A = s
        assert abs(adv[0, 0].item() - 0.8) < 1e-12


@pytest.mark.parametrize("name", ["grpo", "grpo_drgrpo", "rloo", "gpg", "opo", "grpo_passk",
                                  "reinforce_plus_plus_baseline"])
def test_all_equal_scores_give_zero(name):
    R = [[0.0, 1.0], [0.0, 1.0], [0.0, 1.0], [0.0, 0.25], [0.0, 0.25]]
    M = [[1.0, 1.0], [1.0, 1.0], [0.0, 1.0], [1.0, 1.0], [1.0, 1.0]]
    adv, ret = run(name, R, M, ["a", "a", "a", "b", "b"])
    assert torch.isfinite(adv).all() and torch.isfinite(ret).all()
    assert torch.allclose(adv, torch.zeros_like(adv), atol=1e-12)


@pytest.mark.parametrize("name", ALL)
def test_all_masked_rows_and_zero_length(name):
    rng = random.Random(3)
    uids = ["a", "a", "b", "b", "b", "c", "c"]
    B, L = len(uids), 5
    M = ref.random_mask(rng, B, L, zero_rows=False)
    M[1] = [0.0] * L  # zero-length response
    M[4] = [0.0] * L
    R = ref.outcome_rewards(rng, M, binary=False)
    V = [[rng.uniform(-1, 1) for _ in range(L)] for _ in range(B)]
    adv, ret = run(name, R, M, uids, V=V, baselines=[0.1] * B)
    assert torch.isfinite(adv).all() and torch.isfinite(ret).all()
    assert torch.equal(adv[1], torch.zeros(L, dtype=F64)) and torch.equal(adv[4], torch.zeros(L, dtype=F64))
    # still exact on the other rows
    if name in ("grpo", "grpo_drgrpo", "rloo", "gpg", "opo", "grpo_passk"):
        assert_close(adv, ref.broadcast(expected_outcome(name, R, M, uids), M))


def test_opo_group_whose_members_all_have_zero_length():
    R = [[0.0, 0.0], [0.0, 0.0], [0.0, 1.0], [0.0, 0.0]]
    M = [[0.0, 0.0], [0.0, 0.0], [1.0, 1.0], [1.0, 0.0]]
    adv, _ = run("opo", R, M, ["dead", "dead", "live", "live"])
    assert torch.isfinite(adv).all()
    # live: lengths 2 and 1, b = 2*1/3 -> 1 - 2/3, 0 - 2/3
    assert torch.allclose(adv, t([[0, 0], [0, 0], [1 / 3, 1 / 3], [-2 / 3, 0]]), atol=1e-12)


@pytest.mark.parametrize("name", ALL)
def test_entirely_masked_batch_no_nan(name):
    B, L = 4, 3
    M = [[0.0] * L for _ in range(B)]
    R = [[0.0] * L for _ in range(B)]
    V = [[0.5] * L for _ in range(B)]
    adv, ret = run(name, R, M, ["a", "a", "b", "b"], V=V, baselines=[0.0] * B)
    assert torch.isfinite(adv).all() and torch.isfinite(ret).all()
    assert torch.equal(adv, torch.zeros_like(adv))


@pytest.mark.parametrize("name", ["grpo", "rloo", "gpg", "opo", "grpo_passk"])
def test_uid_kinds_and_order(name):
    """Strings, ints and tensors as uids; a permutation of the batch permutes the result."""
    rng = random.Random(11)
    keys = ["u1", "u2", "u1", "u3", "u2", "u3", "u1"]
    M = ref.random_mask(rng, len(keys), 4, zero_rows=False)
    R = ref.outcome_rewards(rng, M, binary=False)
    base, _ = run(name, R, M, keys)
    as_int = [int(k[1:]) * 1000 for k in keys]
    for idx in (as_int, torch.tensor(as_int)):
        adv, _ = run(name, R, M, idx)
        assert torch.allclose(adv, base, atol=1e-12)
    perm = list(range(len(keys)))
    rng.shuffle(perm)
    adv_p, _ = run(name, [R[p] for p in perm], [M[p] for p in perm], [keys[p] for p in perm])
    assert torch.allclose(adv_p, base[perm], atol=1e-12)


def test_estimator_info():
    assert estimator_info("gae").needs_critic
    assert estimator_info("grpo").uses_groups and not estimator_info("grpo").needs_critic
    assert estimator_info("remax").needs_greedy_baseline
    assert estimator_info("grpo_passk").min_group_size == 2
    assert not estimator_info("reinforce_plus_plus").uses_groups
    with pytest.raises(KeyError, match="Did you mean 'grpo'"):
        estimator_info("grpoo")


def test_unknown_estimator_hint():
    with pytest.raises(KeyError, match="Did you mean 'rloo'"):
        compute_advantage("rlooo", token_level_rewards=t([[1.0]]), response_mask=t([[1.0]]), index=["a"])
