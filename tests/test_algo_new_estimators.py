"""optimal_token_baseline, gdpo, the *_vectorized aliases, token-sum aggregation and rollout-IS weights against
the float64 re-derivations in algo_reference.py."""

import math
import random
import statistics

import algo_reference as ref
import pytest
import torch
from algo_reference import single_torch_thread  # noqa: F401  (autouse fixture)

from posttrain.algo import (
    AggNorm,
    agg_loss,
    compute_advantage,
    estimator_info,
    rollout_is_weights,
)
from posttrain.algo.rollout_correction import rollout_probs_diff

F64 = torch.float64


def t(x):
    return torch.tensor(x, dtype=F64)


def assert_close(actual, expected, atol=1e-9):
    a = actual.detach().to(F64).tolist()
    for i, row in enumerate(expected):
        for j, e in enumerate(row):
            assert abs(a[i][j] - e) <= atol * max(1.0, abs(e)), (i, j, a[i][j], e)


def case(seed, binary=False, holes=True, layout="holes"):
    rng = random.Random(seed)
    uids = ref.random_layout(rng, rng.randint(2, 4), 5)
    B, L = len(uids), rng.randint(3, 9)
    M = ref.layout_mask(rng, B, L, layout, holes=holes)
    L = len(M[0])
    R = ref.outcome_rewards(rng, M, binary)
    return rng, uids, M, R


# ----------------------------------------------------------------------------- optimal token baseline


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("with_is", [False, True])
@pytest.mark.parametrize("layout", ref.LAYOUTS)
def test_optimal_token_baseline_random(seed, with_is, layout):
    rng, uids, M, R = case(500 + seed, layout=layout)
    B, L = len(M), len(M[0])
    OLD = [[-rng.uniform(0.01, 3.0) for _ in range(L)] for _ in range(B)]
    SPS = [[rng.uniform(0.05, 1.0) for _ in range(L)] for _ in range(B)]
    W = [[rng.uniform(0.2, 2.0) for _ in range(L)] for _ in range(B)] if with_is else None
    adv, ret = compute_advantage("optimal_token_baseline", token_level_rewards=t(R), response_mask=t(M), index=uids,
                                 old_log_probs=t(OLD), sum_pi_squared=t(SPS),
                                 rollout_is_weights=t(W) if with_is else None)
    e_adv, e_ret = ref.optimal_token_baseline(R, M, uids, OLD, SPS, W)
    assert_close(adv, e_adv)
    assert_close(ret, e_ret)


def test_optimal_token_baseline_equal_weights_is_the_group_mean_return():
    # all W equal per t: B_t is the plain group mean of the returns, as in a per-token GRPO without the std
    R = [[0.0, 1.0], [0.0, 0.0], [0.0, 2.0]]
    M = [[1.0, 1.0]] * 3
    OLD = [[0.0, 0.0]] * 3  # pi = 1 -> w = 1 - 2 + sum_pi2 = sum_pi2 - 1; take sum_pi2 = 2 -> w = 1
    adv, _ = compute_advantage("optimal_token_baseline", token_level_rewards=t(R), response_mask=t(M),
                               index=["a"] * 3, old_log_probs=t(OLD), sum_pi_squared=t([[2.0, 2.0]] * 3))
    assert_close(adv, [[0.0, 0.0], [-1.0, -1.0], [1.0, 1.0]], atol=1e-7)  # up to the 1e-8 in the denominator
    assert estimator_info("optimal_token_baseline").needs_sum_pi_squared


def test_optimal_token_baseline_says_what_it_needs():
    with pytest.raises(ValueError, match="sum_pi_squared"):
        compute_advantage("optimal_token_baseline", token_level_rewards=t([[1.0]]), response_mask=t([[1.0]]),
                          index=["a"])


# ----------------------------------------------------------------------------- gdpo


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("norm_by_std", [True, False])
@pytest.mark.parametrize("layout", ref.LAYOUTS)
def test_gdpo_random(seed, norm_by_std, layout):
    rng, uids, M, _ = case(600 + seed, layout=layout)
    K = rng.randint(1, 3)
    COMPS = [[rng.choice([0.0, 1.0]) if k == 0 else rng.uniform(-3, 3) for k in range(K)] for _ in M]
    weights = [rng.uniform(0.2, 2.0) for _ in range(K)] if seed % 2 else None
    adv, ret = compute_advantage("gdpo", token_level_rewards=t([[0.0] * len(M[0])] * len(M)), response_mask=t(M),
                                 index=uids, reward_components=t(COMPS), reward_weights=weights,
                                 norm_adv_by_std_in_grpo=norm_by_std)
    expected = ref.gdpo(COMPS, M, uids, weights, norm_by_std)
    assert_close(adv, expected)
    assert torch.equal(adv, ret)


def test_gdpo_normalises_each_component_on_its_own():
    """A component 100x larger does not drown the other: after per-component normalisation both weigh equally."""
    uids = ["a"] * 4
    M = [[1.0, 1.0]] * 4
    comps = [[1.0, 0.0], [0.0, 100.0], [1.0, 100.0], [0.0, 0.0]]
    adv, _ = compute_advantage("gdpo", token_level_rewards=t([[0.0, 0.0]] * 4), response_mask=t(M), index=uids,
                               reward_components=t(comps))
    a = adv[:, 0].tolist()
    assert abs(a[0] - a[1]) < 1e-5 and a[2] > a[0] > a[3]  # equal up to the 1e-6 added to each std
    assert_close(adv, ref.gdpo(comps, M, uids))


def test_gdpo_without_components_uses_the_score():
    _, uids, M, R = case(7)
    adv, _ = compute_advantage("gdpo", token_level_rewards=t(R), response_mask=t(M), index=uids)
    assert_close(adv, ref.gdpo([[sum(r)] for r in R], M, uids))


def test_gdpo_weight_count_must_match():
    with pytest.raises(ValueError, match="2 reward weights for 1 reward components"):
        compute_advantage("gdpo", token_level_rewards=t([[1.0], [0.0]]), response_mask=t([[1.0], [1.0]]),
                          index=["a", "a"], reward_components=t([[1.0], [0.0]]), reward_weights=[1.0, 2.0])


# ----------------------------------------------------------------------------- aliases


@pytest.mark.parametrize("alias,base,expected", [("grpo_vectorized", "grpo", ref.grpo),
                                                 ("rloo_vectorized", "rloo", ref.rloo)])
@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("layout", ref.LAYOUTS)
def test_vectorized_names_give_identical_numbers(alias, base, expected, seed, layout):
    _, uids, M, R = case(700 + seed, binary=True, layout=layout)
    a, _ = compute_advantage(alias, token_level_rewards=t(R), response_mask=t(M), index=uids)
    b, _ = compute_advantage(base, token_level_rewards=t(R), response_mask=t(M), index=uids)
    assert torch.equal(a, b)
    assert_close(a, ref.broadcast(expected(R, uids), M))
    assert estimator_info(alias) == estimator_info(base)


# ----------------------------------------------------------------------------- token-sum


def test_token_sum_has_no_normaliser_and_ignores_the_mini_batch_norm():
    loss = t([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    mask = t([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    assert float(agg_loss(loss, mask, "token-sum")) == 7.0
    assert float(agg_loss(loss, mask, "token-sum", norm=AggNorm(100.0, 10.0, 5.0))) == 7.0
    assert float(agg_loss(loss, torch.zeros_like(mask), "token-sum")) == 0.0


# ----------------------------------------------------------------------------- rollout correction weights


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("threshold", [2.0, 1.2])
@pytest.mark.parametrize("normalize", [False, True])
@pytest.mark.parametrize("layout", ref.LAYOUTS)
@pytest.mark.parametrize("mode", ["truncate", "mask"])
def test_rollout_is_weights_random(seed, level, threshold, normalize, layout, mode):
    rng = random.Random(800 + seed)
    B, L = rng.randint(3, 7), rng.randint(2, 8)
    M = ref.layout_mask(rng, B, L, layout)
    L = len(M[0])
    ROLL = [[-rng.uniform(0.05, 3.0) for _ in range(L)] for _ in range(B)]
    OLD = [[r + rng.uniform(-0.4, 0.4) for r in row] for row in ROLL]
    w, metrics = rollout_is_weights(t(OLD), t(ROLL), t(M), level=level, threshold=threshold,
                                    batch_normalize=normalize, mode=mode)
    assert_close(w, ref.rollout_is_weights(OLD, ROLL, M, level, threshold, normalize, mode))
    assert not w.requires_grad
    rho = ref.rollout_is_weights(OLD, ROLL, M, level, float("inf"))
    high = [1.0 if x > threshold else 0.0 for x in ref.flat(rho)]
    assert abs(metrics["rollout_corr/rollout_is_ratio_fraction_high"] - ref.masked_mean(high, ref.flat(M))) < 1e-9


def test_rollout_is_weights_hand():
    old = t([[-1.0, -1.0, -2.0]])
    roll = t([[-1.5, -0.5, -9.0]])
    m = t([[1.0, 1.0, 0.0]])
    w, _ = rollout_is_weights(old, roll, m, level="token", threshold=1.5)
    assert_close(w, [[1.5, 0.6065306597126334, 0.0]])  # e^0.5 = 1.65 truncated; e^-0.5; masked
    w, _ = rollout_is_weights(old, roll, m, level="sequence", threshold=2.0)
    assert_close(w, [[1.0, 1.0, 0.0]])  # the log-ratios cancel over the response
    w, _ = rollout_is_weights(old, roll, m, level="token", threshold=1.5, mode="mask")
    assert_close(w, [[0.0, 0.6065306597126334, 0.0]])  # e^0.5 = 1.65 > 1.5: masked, not truncated
    with pytest.raises(ValueError, match="rollout_is_mode='clip'"):
        rollout_is_weights(old, roll, m, level="token", threshold=2.0, mode="clip")
    with pytest.raises(ValueError, match="rollout_is='tokens'"):
        rollout_is_weights(old, roll, m, level="tokens", threshold=2.0)


def test_rollout_probs_diff_hand():
    """The rollout-vs-trainer probability gap over response tokens only: |p_old - p_rollout| of 0.1, 0 and 0.2."""
    old = t([[0.5, 0.25, 0.125], [0.8, 0.1, 0.3]]).log()
    roll = t([[0.4, 0.25, 0.9], [0.6, 0.3, 0.3]]).log()
    m = t([[1, 1, 0], [1, 0, 0]])
    out = rollout_probs_diff(old, roll, m)
    assert out["training/rollout_probs_diff_valid"] == 1.0
    assert math.isclose(out["training/rollout_probs_diff_max"], 0.2, rel_tol=1e-12)
    assert math.isclose(out["training/rollout_probs_diff_mean"], 0.1, rel_tol=1e-12)
    assert math.isclose(out["training/rollout_probs_diff_std"], 0.1, rel_tol=1e-12)  # sample std of 0.1, 0, 0.2
    assert math.isclose(out["training/rollout_actor_probs_pearson_corr"],
                        statistics.correlation([0.5, 0.25, 0.8], [0.4, 0.25, 0.6]), rel_tol=1e-12)
    assert rollout_probs_diff(old, roll, torch.zeros_like(m)) == {"training/rollout_probs_diff_valid": 0.0}
    one = rollout_probs_diff(old, roll, t([[1, 0, 0], [0, 0, 0]]))  # one token: no spread, no correlation
    assert one["training/rollout_probs_diff_std"] == 0.0 and "training/rollout_actor_probs_pearson_corr" not in one
