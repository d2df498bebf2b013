"""Bypass mode's REINFORCE loss (`rollout_correction.loss_type=reinforce`), the token veto and verl's former
rejection levels, the `dro` policy loss and the `tir_optimal_token_baseline` estimator, each against a float64
re-derivation written here with plain loops from verl's definitions (not from posttrain's code)."""

import math
import random

import algo_reference as ref
import pytest
import torch
from algo_reference import single_torch_thread  # noqa: F401  (autouse fixture)

from posttrain.algo import LOSS_AGG_MODES, AggNorm, LossSettings, compute_advantage, estimator_info, get_policy_loss
from posttrain.algo.bypass import BypassSettings, bypass_loss
from posttrain.algo.rollout_correction import legacy_rejection, rollout_rejection_mask

F64 = torch.float64
C = 11.0


def t(x):
    return torch.tensor(x, dtype=F64)


def close(a, b, tol=1e-10):
    a = float(a.detach()) if isinstance(a, torch.Tensor) else float(a)
    return abs(a - b) <= tol * max(1.0, abs(b))


def batch(seed, layout="holes", spread=0.7):
    rng = random.Random(seed)
    B, L = rng.randint(3, 6), rng.randint(3, 8)
    M = ref.layout_mask(rng, B, L, layout)
    L = len(M[0])
    ROLL = [[-rng.uniform(0.05, 3.0) for _ in range(L)] for _ in range(B)]
    LP = [[min(r + rng.uniform(-spread, spread), -1e-3) for r in row] for row in ROLL]
    ADV = [[rng.uniform(-2.0, 2.0) for _ in range(L)] for _ in range(B)]
    return rng, LP, ROLL, ADV, M


def is_weights(LP, ROLL, M, level, threshold, normalize):
    """verl's compute_rollout_correction_weights with pi = the current policy: rho per token (exp of the clamped
    log-ratio) or per response (exp of the clamped sum over the response), times m; a number truncates, a range
    lower_upper zeroes what lies outside it; normalised by the mean over valid tokens (sum / (count + 1e-8), verl's
    masked_mean) or valid responses."""
    B, L = len(M), len(M[0])
    W = [[0.0] * L for _ in range(B)]
    lower, upper = (float(x) for x in threshold.split("_")) if isinstance(threshold, str) else (None, threshold)
    for i in range(B):
        seq = math.exp(ref.clamp(sum((LP[i][k] - ROLL[i][k]) * M[i][k] for k in range(L)), -20.0, 20.0))
        for k in range(L):
            rho = (math.exp(ref.clamp(LP[i][k] - ROLL[i][k], -20.0, 20.0)) if level == "token" else seq) * M[i][k]
            W[i][k] = min(rho, upper) if lower is None else (rho if lower <= rho <= upper else 0.0)
    if normalize:
        if level == "token":
            mean = sum(W[i][k] * M[i][k] for i in range(B) for k in range(L)) / (sum(ref.flat(M)) + 1e-8)
        else:
            rows = [i for i in range(B) if sum(M[i]) > 0]
            mean = sum(max(W[i][k] * M[i][k] for k in range(L)) for i in rows) / len(rows)
        W = [[w / mean for w in row] for row in W]
    return W


# ----------------------------------------------------------------------------- bypass mode: REINFORCE


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
@pytest.mark.parametrize("level", [None, "token", "sequence"])
def test_reinforce_loss_and_gradient_are_minus_advantage_times_weighted_log_prob(seed, mode, level):
    """loss = agg(-A * logp * w), w = sg(pi / pi_rollout) truncated at the threshold (or 1 without rollout_is);
    gradient d loss / d logp = -A * w times the aggregation's weight of the token; ppo_kl = mean(logp_rollout -
    logp). With batch normalisation the weights are divided by their mean."""
    _, LP, ROLL, ADV, M = batch(10 + seed, layout=ref.LAYOUTS[seed % 2])
    for threshold, normalize in ((2.0, False), (1.5, True), ("0.5_1.8", False)):
        bypass = BypassSettings("reinforce", level, threshold, "truncate", normalize)
        lp = t(LP).requires_grad_(True)
        loss, metrics = bypass_loss(get_policy_loss("vanilla"), lp, t(ROLL), t(ADV), t(M), bypass=bypass,
                                    settings=LossSettings(loss_agg_mode=mode, const=C), norm=None)
        W = (is_weights(LP, ROLL, M, level, threshold, normalize) if level is not None
             else [[1.0] * len(M[0]) for _ in M])
        LM = [[-a * lp_ * w for a, lp_, w in zip(ra, rl, rw)] for ra, rl, rw in zip(ADV, LP, W)]
        assert close(loss, ref.agg(LM, M, mode, C=C)), (threshold, normalize)
        (grad,) = torch.autograd.grad(loss, lp)
        B, L = len(M), len(M[0])
        for i in range(B):
            for k in range(L):  # the loss is linear in each logp: its gradient is the loss of unit logp
                unit = [[(-ADV[i][k] * W[i][k]) if (r, c) == (i, k) else 0.0 for c in range(L)] for r in range(B)]
                assert close(grad[i, k], ref.agg(unit, M, mode, C=C)), (i, k)
        kl = ref.masked_mean([r - p for r, p in zip(ref.flat(ROLL), ref.flat(LP))], ref.flat(M))
        assert close(metrics["actor/ppo_kl"], kl, 1e-9)


def test_reinforce_batch_normalisation_takes_the_mean_over_every_rank():
    """The weights' mean is over the micro-batch of every data-parallel rank: the sum and count this rank has are
    summed over ranks (here: another rank holds the same rows again with weights twice as large, so the mean is
    1.5 x this rank's)."""
    _, LP, ROLL, ADV, M = batch(3)
    bypass = BypassSettings("reinforce", "token", 10.0, "truncate", True)
    settings = LossSettings(loss_agg_mode="token-mean")
    alone, m1 = bypass_loss(get_policy_loss("vanilla"), t(LP), t(ROLL), t(ADV), t(M), bypass=bypass,
                            settings=settings, norm=None)
    two, m2 = bypass_loss(get_policy_loss("vanilla"), t(LP), t(ROLL), t(ADV), t(M), bypass=bypass, settings=settings,
                          norm=None, sum_over_ranks=lambda parts: parts + torch.stack([2 * parts[0], parts[1]]))
    assert close(two, float(alone) / 1.5, 1e-8)  # (up to the 1e-8 of the token mean's denominator)
    assert close(m2["rollout_corr/rollout_is_batch_norm_factor"], 1.5 * m1["rollout_corr/rollout_is_batch_norm_factor"],
                 1e-8)


def test_bypass_ppo_clip_runs_the_configured_loss_without_weights_on_the_kept_tokens():
    """loss_type=ppo_clip with rejection: the configured loss with old = rollout on the mask the rejection keeps,
    no importance weights; the normaliser stays the mini-batch's (norm)."""
    _, LP, ROLL, ADV, M = batch(5)
    norm = AggNorm(tokens=float(sum(ref.flat(M))), seqs=float(sum(1 for r in M if sum(r))), const=C)
    bypass = BypassSettings("ppo_clip", "token", 2.0, rollout_rs="token_k1", rollout_rs_threshold="0.7_1.4")
    loss, metrics = bypass_loss(get_policy_loss("vanilla"), t(LP), t(ROLL), t(ADV), t(M), bypass=bypass,
                                settings=LossSettings(), norm=norm)
    keep = [[m if 0.7 <= math.exp(-(lp - r)) <= 1.4 else 0.0 for lp, r, m in zip(a, b, c)]
            for a, b, c in zip(LP, ROLL, M)]  # k1 = -log(pi / pi_rollout) in [log 0.7, log 1.4]
    assert sum(ref.flat(keep)) < sum(ref.flat(M))
    want = ref.vanilla(LP, ROLL, ADV, keep, "token-mean")
    assert close(loss * norm.tokens, want[0] * sum(ref.flat(keep)))
    assert "rollout_corr/rollout_rs_token_k1_masked_fraction" in metrics


# ----------------------------------------------------------------------------- the veto and the former levels


def test_token_veto_rejects_every_response_with_a_token_below_it():
    """rollout_token_veto_threshold v: a response is kept only if no real token has pi_old / pi_rollout < v."""
    v, outcomes = 0.3, set()
    for seed in range(4):
        _, OLD, ROLL, _, M = batch(30 + seed, layout=ref.LAYOUTS[seed % 2], spread=2.5)
        keep, metrics = rollout_rejection_mask(t(OLD), t(ROLL), t(M), options=None, threshold=None, veto=v)
        rows = [i for i in range(len(M)) if sum(M[i])]
        vetoed = {i for i in rows if any(M[i][k] and math.exp(OLD[i][k] - ROLL[i][k]) < v
                                         for k in range(len(M[i])))}
        outcomes |= {i in vetoed for i in rows}
        for i in range(len(M)):
            for k in range(len(M[i])):
                assert float(keep[i, k]) == (0.0 if i in vetoed else M[i][k])
        assert close(metrics["rollout_corr/rollout_is_veto_fraction"], len(vetoed) / len(rows))
    assert outcomes == {True, False}  # the cases exercise both


@pytest.mark.parametrize("level", ["token", "sequence", "geometric"])
@pytest.mark.parametrize("seed", range(3))
def test_former_rejection_levels_keep_ratios_within_their_bounds(level, seed):
    """verl's former rollout_rs=token|sequence|geometric kept a token / response whose ratio (per token, product
    over the response, geometric mean over it) lay in [lower, upper]; read as today's k1 option and range."""
    _, OLD, ROLL, _, M = batch(50 + seed, spread=0.5)
    lower, upper = 0.8, 1.3
    option, threshold = legacy_rejection(level, upper, lower)
    keep, _ = rollout_rejection_mask(t(OLD), t(ROLL), t(M), options=option, threshold=threshold)
    for i in range(len(M)):
        n = sum(M[i])
        total = sum((OLD[i][k] - ROLL[i][k]) * M[i][k] for k in range(len(M[i])))
        for k in range(len(M[i])):
            ratio = {"token": math.exp(OLD[i][k] - ROLL[i][k]), "sequence": math.exp(total),
                     "geometric": math.exp(total / n) if n else 1.0}[level]
            assert float(keep[i, k]) == (M[i][k] if lower <= ratio <= upper else 0.0), (i, k, ratio)
    assert legacy_rejection("token", 2.0, None) == ("token_k1", "0.5_2.0")  # lower null: 1 / upper


# ----------------------------------------------------------------------------- dro


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_dro_is_the_policy_gradient_with_a_quadratic_log_ratio_penalty(seed, mode):
    """verl's dro: agg(-(logp * A - beta / 2 * (logp - logp_old)^2) * w); d/dlogp = -(A - beta (logp - logp_old)) w."""
    rng, LP, OLD, ADV, M = batch(70 + seed, layout=ref.LAYOUTS[seed % 2])
    W = [[rng.uniform(0.5, 1.5) for _ in row] for row in M]
    beta = 0.3
    lp = t(LP).requires_grad_(True)
    loss, metrics = get_policy_loss("dro")(lp, t(OLD), t(ADV), t(M), settings=LossSettings(mode, const=C,
                                                                                          dro_beta=beta),
                                           norm=None, rollout_is_weights=t(W))
    LM = [[-(p * a - 0.5 * beta * (p - o) ** 2) * w for p, o, a, w in zip(*rows)] for rows in zip(LP, OLD, ADV, W)]
    assert close(loss, ref.agg(LM, M, mode, C=C))
    (grad,) = torch.autograd.grad(loss, lp)
    B, L = len(M), len(M[0])
    for i in range(B):
        for k in range(L):
            d = -(ADV[i][k] - beta * (LP[i][k] - OLD[i][k])) * W[i][k]
            unit = [[d if (r, c) == (i, k) else 0.0 for c in range(L)] for r in range(B)]
            assert close(grad[i, k], ref.agg(unit, M, mode, C=C)), (i, k)
    assert close(metrics["actor/ppo_kl"], ref.masked_mean([o - p for o, p in zip(ref.flat(OLD), ref.flat(LP))],
                                                          ref.flat(M)), 1e-9)
    with pytest.raises(ValueError, match="dro_beta"):
        get_policy_loss("dro")(lp, t(OLD), t(ADV), t(M), settings=LossSettings(), norm=None, rollout_is_weights=None)


# ----------------------------------------------------------------------------- tir_optimal_token_baseline


def tir_otb(R, M, uids, OLD, SPS, W=None):
    """verl's multi-turn OTB: each response's policy tokens (m = 1) in order; G the return-to-go and
    W_k = sum_{j<=k} (1 - 2 exp(logp_old) + sum pi^2) [* w^2] at its k-th policy token; per group of responses
    with at least one policy token, B_k = sum_j G_jk W_jk / (sum_j W_jk + 1e-8) over those with a k-th token (0
    for a group of one), and 0 from the second-longest count on for a group's one longest response; A = G - B at
    the policy tokens."""
    B_, L = len(M), len(M[0])
    G = [[0.0] * L for _ in range(B_)]
    comp_G, comp_W, cols = [], [], []
    for i in range(B_):
        acc = 0.0
        for k in range(L - 1, -1, -1):
            acc += R[i][k] * M[i][k]
            G[i][k] = acc
        run, gs, ws, cs = 0.0, [], [], []
        for k in range(L):
            if M[i][k]:
                x = 1 - 2 * math.exp(OLD[i][k]) + SPS[i][k]
                run += x * (W[i][k] ** 2 if W is not None else 1.0)
                gs.append(G[i][k])
                ws.append(run)
                cs.append(k)
        comp_G.append(gs)
        comp_W.append(ws)
        cols.append(cs)
    A = [[0.0] * L for _ in range(B_)]
    for members in ref.groups_of(uids).values():
        members = [j for j in members if cols[j]]
        lens = {j: len(cols[j]) for j in members}
        ranked = sorted(lens.values(), reverse=True)
        for j in members:
            for k, col in enumerate(cols[j]):
                if len(members) == 1:
                    b = 0.0
                elif ranked[0] > ranked[1] and lens[j] == ranked[0] and k >= ranked[1]:
                    b = 0.0
                else:
                    num = sum(comp_G[h][k] * comp_W[h][k] for h in members if k < lens[h])
                    b = num / (sum(comp_W[h][k] for h in members if k < lens[h]) + 1e-8)
                A[j][col] = comp_G[j][k] - b
    return A, [[G[i][k] for k in range(L)] for i in range(B_)]


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("with_is", [False, True])
@pytest.mark.parametrize("layout", ref.LAYOUTS)
def test_tir_optimal_token_baseline_compares_responses_at_their_kth_policy_token(seed, with_is, layout):
    rng = random.Random(900 + seed)
    uids = ref.random_layout(rng, rng.randint(2, 4), 5)
    M = ref.layout_mask(rng, len(uids), rng.randint(3, 9), layout)
    B, L = len(M), len(M[0])
    R = ref.outcome_rewards(rng, M, False)
    OLD = [[-rng.uniform(0.01, 3.0) for _ in range(L)] for _ in range(B)]
    SPS = [[rng.uniform(0.05, 1.0) for _ in range(L)] for _ in range(B)]
    W = [[rng.uniform(0.2, 2.0) for _ in range(L)] for _ in range(B)] if with_is else None
    adv, ret = compute_advantage("tir_optimal_token_baseline", token_level_rewards=t(R), response_mask=t(M),
                                 index=uids, old_log_probs=t(OLD), sum_pi_squared=t(SPS),
                                 rollout_is_weights=t(W) if with_is else None)
    e_adv, e_ret = tir_otb(R, M, uids, OLD, SPS, W)
    for i in range(B):
        for k in range(L):
            assert abs(float(adv[i, k]) - e_adv[i][k]) <= 1e-9 * max(1.0, abs(e_adv[i][k])), (i, k)
            assert abs(float(ret[i, k]) - e_ret[i][k]) <= 1e-12 * max(1.0, abs(e_ret[i][k]))
    assert estimator_info("tir_optimal_token_baseline").needs_sum_pi_squared


def test_tir_and_plain_otb_differ_where_an_observation_shifts_the_columns():
    """Two responses of one prompt, the second with a 2-token tool result after its first token: the plain OTB
    compares column 1 (the first's second token with the second's observation), the TIR one the second tokens."""
    R = [[0.0, 0.0, 1.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0, 0.0]]
    M = [[1.0, 1.0, 1.0, 0.0, 0.0], [1.0, 0.0, 0.0, 1.0, 1.0]]
    OLD, SPS = [[-1.0] * 5] * 2, [[0.5] * 5] * 2
    args = dict(token_level_rewards=t(R), response_mask=t(M), index=["a", "a"], old_log_probs=t(OLD),
                sum_pi_squared=t(SPS))
    tir, _ = compute_advantage("tir_optimal_token_baseline", **args)
    plain, _ = compute_advantage("optimal_token_baseline", **args)
    assert abs(float(tir[0, 1]) - 0.5) < 1e-6 and abs(float(tir[1, 3]) + 0.5) < 1e-6  # k = 1: returns 1 and 0
    assert abs(float(plain[0, 1])) < 1e-6  # column 1: the first response alone there, its own return as baseline


# ----------------------------------------------------------------------------- the config keys


def test_config_keys_of_bypass_reinforce_dro_and_the_former_spellings():
    from posttrain.config import ConfigError, config_warnings, load_config

    ok = ["data.train_batch_size=8", "actor_rollout_ref.actor.ppo_mini_batch_size=4"]
    rc = "algorithm.rollout_correction."
    cfg = load_config(None, ok + [rc + "bypass_mode=True", rc + "use_policy_gradient=True", rc + "rollout_is=sequence",
                                  rc + "rollout_rs=token", rc + "rollout_rs_threshold=2.0",
                                  rc + "rollout_rs_threshold_lower=0.8", rc + "rollout_token_veto_threshold=1e-4",
                                  "actor_rollout_ref.actor.policy_loss.loss_mode=gspo"])
    got = cfg.algorithm.rollout_correction
    assert (got.loss_type, got.rollout_rs, got.rollout_rs_threshold) == ("reinforce", "token_k1", "0.5_1.25")
    bypass = BypassSettings.of(got)
    assert bypass.loss_type == "reinforce" and bypass.veto == 1e-4 and bypass.rollout_is == "sequence"
    notes = "\n".join(config_warnings(cfg))
    assert "REINFORCE with explicit importance weights" in notes and "loss_mode=gspo" in notes
    assert "no importance weights are applied" not in notes  # that note is ppo_clip's
    alone = load_config(None, ok + [rc + "loss_type=reinforce"])
    assert "no effect without algorithm.rollout_correction.bypass_mode=True" in "\n".join(config_warnings(alone))
    lone = load_config(None, ok + ["algorithm.adv_estimator=rloo", "actor_rollout_ref.rollout.n=1"])
    assert any("adv_estimator=rloo with actor_rollout_ref.rollout.n=1" in n for n in config_warnings(lone))
    for bad, fragment in (([rc + "loss_type=pg"], "is not one of ['ppo_clip', 'reinforce']"),
                          ([rc + "rollout_token_veto_threshold=0"], "must be positive"),
                          ([rc + "rollout_rs=token_k1", rc + "rollout_rs_threshold=2",
                            rc + "rollout_rs_threshold_lower=0.5"], "goes with verl's former levels"),
                          (["actor_rollout_ref.actor.policy_loss.loss_mode=dro"], "dro_beta > 0")):
        with pytest.raises(ConfigError, match=fragment.replace("[", r"\[").replace("]", r"\]")):
            load_config(None, ok + bad)
    assert load_config(None, ok + ["actor_rollout_ref.actor.policy_loss.loss_mode=dro",
                                   "actor_rollout_ref.actor.policy_loss.dro_beta=0.1"])


@pytest.mark.parametrize("seed", range(4))
def test_tir_optimal_token_baseline_is_the_plain_one_on_right_padded_rows(seed):
    rng = random.Random(950 + seed)
    uids = ref.random_layout(rng, rng.randint(2, 4), 5)
    M = ref.random_mask(rng, len(uids), rng.randint(3, 9), holes=False)
    B, L = len(M), len(M[0])
    args = dict(token_level_rewards=t(ref.outcome_rewards(rng, M, False)), response_mask=t(M), index=uids,
                old_log_probs=t([[-rng.uniform(0.01, 3.0) for _ in range(L)] for _ in range(B)]),
                sum_pi_squared=t([[rng.uniform(0.05, 1.0) for _ in range(L)] for _ in range(B)]))
    tir, _ = compute_advantage("tir_optimal_token_baseline", **args)
    plain, _ = compute_advantage("optimal_token_baseline", **args)
    assert torch.allclose(tir, plain, rtol=1e-12, atol=1e-12)
