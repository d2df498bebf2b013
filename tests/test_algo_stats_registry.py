"""Masked statistics, group ids, and the name registries users extend (ALGORITHMS.md, Notation)."""

import random
import statistics

import pytest
import torch

import algo_reference as ref
from algo_reference import single_torch_thread  # noqa: F401  (autouse fixture)
from posttrain.algo import (ADVANTAGE_ESTIMATORS, KL_ESTIMATORS, POLICY_LOSSES, compute_advantage,
                            estimator_info, get_advantage_estimator, get_policy_loss,
                            group_ids, is_kl_estimator, kl_penalty, masked_mean, masked_var, masked_whiten,
                            register_advantage, register_kl, register_policy_loss)
from posttrain.algo import advantages as advantages_module
from posttrain.algo.staleness import staleness_metrics

F64 = torch.float64


def t(x, dtype=F64):
    return torch.tensor(x, dtype=dtype)


# ----------------------------------------------------------------------------- stats


@pytest.mark.parametrize("layout", ref.LAYOUTS)
@pytest.mark.parametrize("seed", range(5))
def test_masked_mean_var_whiten(seed, layout):
    rng = random.Random(seed)
    B, L = rng.randint(2, 6), rng.randint(2, 8)
    M = ref.layout_mask(rng, B, L, layout, zero_rows=True)
    L = len(M[0])
    if sum(ref.flat(M)) < 2:
        M[0][:2] = [1.0, 1.0]
    X = [[rng.uniform(-5, 5) for _ in range(L)] for _ in range(B)]
    xs, ms = ref.flat(X), ref.flat(M)
    assert abs(masked_mean(t(X), t(M)).item() - ref.masked_mean(xs, ms)) < 1e-12
    var = masked_var(t(X), t(M)).item()
    assert abs(var - ref.masked_var(xs, ms)) < 1e-10
    assert abs(var - statistics.variance([x for x, m in zip(xs, ms) if m])) < 1e-10  # unbiased, N-1
    W = masked_whiten(t(X), t(M)).tolist()
    E = ref.masked_whiten(X, M)
    for i in range(B):
        for j in range(L):
            if M[i][j]:
                assert abs(W[i][j] - E[i][j]) < 1e-9
    # per-row mean with dim
    rows = masked_mean(t(X), t(M), dim=-1).tolist()
    for i in range(B):
        assert abs(rows[i] - ref.masked_mean(X[i], M[i])) < 1e-12


def test_masked_var_is_unbiased_hand():
    # entries 1, 2, 3, 6 (one masked 100): mean 3, squares 4+1+0+9 = 14, / 3
    x = t([[1.0, 2.0, 100.0], [3.0, 6.0, 0.0]])
    m = t([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]])
    assert abs(masked_var(x, m).item() - 14 / 3) < 1e-9


def test_masked_stats_all_masked_no_nan():
    x = t([[1.0, 2.0]])
    m = t([[0.0, 0.0]])
    assert masked_mean(x, m).item() == 0.0
    assert torch.isfinite(masked_var(x, m)) and torch.isfinite(masked_whiten(x, m)).all()
    assert torch.isfinite(masked_var(x, t([[1.0, 0.0]])))


def test_group_ids():
    ids = group_ids(["b", "a", "b", "c", "a"]).tolist()
    assert ids[0] == ids[2] and ids[1] == ids[4] and len(set(ids)) == 3 and sorted(set(ids)) == [0, 1, 2]
    ids = group_ids(torch.tensor([7, 3, 7, 9])).tolist()
    assert ids[0] == ids[2] and len(set(ids)) == 3 and sorted(set(ids)) == [0, 1, 2]
    ids = group_ids([10, 10, 11]).tolist()
    assert ids == [0, 0, 1]


# ----------------------------------------------------------------------------- registries


@pytest.fixture
def cleanup():
    added = []
    yield added
    for registry, name in added:
        registry._table.pop(name, None)
        advantages_module.ESTIMATOR_INFO.pop(name, None)


def test_user_advantage_estimator(cleanup):
    @register_advantage("_test_half_score", uses_groups=True)
    def half(inputs):
        a = 0.5 * inputs.token_level_rewards.sum(-1, keepdim=True) * inputs.response_mask
        return a, a

    cleanup.append((ADVANTAGE_ESTIMATORS, "_test_half_score"))
    assert get_advantage_estimator("_test_half_score") is half
    adv, _ = compute_advantage("_test_half_score", token_level_rewards=t([[0.0, 2.0]]), response_mask=t([[1.0, 1.0]]),
                               index=["a"])
    assert torch.equal(adv, t([[1.0, 1.0]]))
    assert estimator_info("_test_half_score").uses_groups
    assert "_test_half_score" in ADVANTAGE_ESTIMATORS.names()
    with pytest.raises(KeyError, match="Did you mean '_test_half_score'"):
        compute_advantage("_test_half_scor")


def test_user_policy_loss(cleanup):
    @register_policy_loss("_test_neg_mean")
    def neg_mean(log_prob, old_log_prob, advantages, response_mask, *, settings=None, norm=None,
                 rollout_is_weights=None):
        return -(log_prob * response_mask).sum(), {}

    cleanup.append((POLICY_LOSSES, "_test_neg_mean"))
    assert "_test_neg_mean" in POLICY_LOSSES
    loss, _ = get_policy_loss("_test_neg_mean")(t([[-1.0, -2.0]]), None, None, t([[1.0, 0.0]]))
    assert loss.item() == 1.0
    with pytest.raises(KeyError, match="Did you mean '_test_neg_mean'"):
        get_policy_loss("_test_neg_meen")


def test_user_kl(cleanup):
    @register_kl("_test_quartic", "_test_q4")
    def quartic(d):
        return d ** 4

    cleanup += [(KL_ESTIMATORS, "_test_quartic"), (KL_ESTIMATORS, "_test_q4")]
    x = t([1.5, -1.0]).requires_grad_(True)
    y = t([0.5, 0.0])
    assert torch.allclose(kl_penalty(x, y, "_test_quartic"), t([1.0, 1.0]))
    assert torch.allclose(kl_penalty(x, y, "_test_q4"), t([1.0, 1.0]))
    assert is_kl_estimator("_test_quartic+")
    out = kl_penalty(x, y, "_test_quartic+")  # value of the user's estimator, gradient of k2 (= d)
    out.sum().backward()
    assert torch.allclose(out, t([1.0, 1.0])) and torch.allclose(x.grad, t([1.0, -1.0]))
    with pytest.raises(KeyError, match="Did you mean '_test_quartic'"):
        kl_penalty(x, y, "_test_quartik")


def test_registering_a_taken_name_needs_override(cleanup):
    """A built-in name is never replaced by accident: grpo keeps its function and its `uses_groups` metadata."""
    grpo_fn = get_advantage_estimator("grpo")
    with pytest.raises(ValueError, match=r"\['grpo'\] is already registered; pass override=True"):
        @register_advantage("grpo")
        def mine(**_):
            raise AssertionError
    assert get_advantage_estimator("grpo") is grpo_fn and estimator_info("grpo").uses_groups
    for register, name in ((register_policy_loss, "vanilla"), (register_kl, "k3")):
        with pytest.raises(ValueError, match="pass override=True"):
            register(name)(lambda *a, **k: None)
    with pytest.raises(TypeError):  # metadata typos fail before anything is registered
        register_advantage("_test_bad_meta", uses_group=True)
    assert "_test_bad_meta" not in ADVANTAGE_ESTIMATORS

    first, second = get_advantage_estimator("grpo"), get_advantage_estimator("rloo")  # well-formed signatures
    register_advantage("_test_twice")(first)
    register_advantage("_test_twice", override=True, uses_groups=True)(second)

    cleanup.append((ADVANTAGE_ESTIMATORS, "_test_twice"))
    assert get_advantage_estimator("_test_twice") is second and estimator_info("_test_twice").uses_groups


def test_unknown_name_without_close_match_lists_known():
    with pytest.raises(KeyError) as err:
        get_policy_loss("zzzzzzzzzzzz")
    assert "Did you mean" not in str(err.value) and "vanilla" in str(err.value)


# ----------------------------------------------------------------------------- staleness (asynchronous RL)


def test_staleness_metrics_hand():
    """Trainer at version 5; policy tokens sampled at versions 5, 4, 4, 1 (staleness 0, 1, 1, 4); the tool tokens
    (mask 0, version 0) and the padding count nowhere."""
    versions = torch.tensor([[5, 0, 4, 4], [1, 0, 0, 0]])
    mask = torch.tensor([[1, 0, 1, 1], [1, 0, 0, 0]])
    out = staleness_metrics(versions, mask, 5)
    assert out == {"async/staleness_mean": 1.5, "async/staleness_max": 4.0, "async/staleness_le_0": 0.25,
                   "async/staleness_le_1": 0.75, "async/staleness_le_2": 0.75, "async/staleness_le_4": 1.0,
                   "async/staleness_le_8": 1.0}
    assert staleness_metrics(versions, torch.zeros_like(mask), 5) == {}  # no policy token: nothing to report
    synchronous = staleness_metrics(torch.full((2, 4), 7) * mask, mask, 7)
    assert synchronous["async/staleness_max"] == 0.0 and synchronous["async/staleness_le_0"] == 1.0


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("layout", ref.LAYOUTS)
def test_staleness_metrics_random(seed, layout):
    rng = random.Random(300 + seed)
    B, L = rng.randint(2, 6), rng.randint(3, 9)
    M = ref.layout_mask(rng, B, L, layout)
    V = [[rng.randint(0, 12) * int(m) for m in row] for row in M]
    out = staleness_metrics(torch.tensor(V), torch.tensor(M), 12)
    expect = ref.staleness(V, M, 12)
    assert out.keys() == expect.keys()
    assert all(abs(out[k] - expect[k]) < 1e-12 for k in expect)


def test_staleness_metrics_reject_a_version_newer_than_the_trainer_and_a_shape_mismatch():
    mask = torch.ones(1, 3)
    with pytest.raises(ValueError, match="version 4, newer than the trainer's version 3"):
        staleness_metrics(torch.tensor([[3, 4, 2]]), mask, 3)
    with pytest.raises(ValueError, match="differ in shape"):
        staleness_metrics(torch.tensor([[3, 3]]), mask, 3)
