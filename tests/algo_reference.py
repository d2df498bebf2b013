"""Independent re-derivations of /work/shared/ALGORITHMS.md for the algo tests.

Everything here is written from the spec text alone, in Python floats (IEEE float64) with plain loops over
lists. It never imports `posttrain` (torch/pytest only for the thread fixture). Inputs are nested lists (rows = responses, columns = response tokens);
helpers `to_lists` / `flat` convert.
"""

from __future__ import annotations

import math
import random
from collections import OrderedDict

import pytest
import torch


# ----------------------------------------------------------------------------- small helpers


@pytest.fixture(scope="module", autouse=True)
def single_torch_thread():
    """The algo tests use tiny tensors: one intra-op thread avoids thread start-up and contention on busy hosts.
    Imported by every tests/test_algo_*.py module; the previous setting is restored afterwards."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def to_lists(x):
    """A tensor (or nested list) -> nested Python floats."""
    if hasattr(x, "tolist"):
        x = x.tolist()
    return x


def flat(rows):
    return [v for row in rows for v in row]


def clamp(x, lo=None, hi=None):
    if lo is not None and x < lo:
        x = lo
    if hi is not None and x > hi:
        x = hi
    return x


def groups_of(uids):
    """uid -> list of response indices, in batch order."""
    table = OrderedDict()
    for i, u in enumerate(uids):
        table.setdefault(u, []).append(i)
    return table


# ----------------------------------------------------------------------------- Notation helpers


def masked_mean(xs, ms):
    """masked_mean(x, m) = sum(x*m) / (sum(m) + 1e-8)   (flat lists)."""
    num = 0.0
    den = 0.0
    for x, m in zip(xs, ms):
        num += x * m
        den += m
    return num / (den + 1e-8)


def masked_var(xs, ms):
    """Unbiased (N-1) variance over the entries with m=1 (flat lists)."""
    vals = [x for x, m in zip(xs, ms) if m]
    n = len(vals)
    mean = sum(vals) / n
    return sum((v - mean) ** 2 for v in vals) / (n - 1)


def masked_whiten(X, M):
    """(x - masked_mean) / sqrt(masked_var + 1e-8), statistics pooled over every valid token of the batch."""
    xs, ms = flat(X), flat(M)
    mu = masked_mean(xs, ms)
    var = masked_var(xs, ms)
    sd = math.sqrt(var + 1e-8)
    return [[(x - mu) / sd for x in row] for row in X]


# ----------------------------------------------------------------------------- advantage estimators


def scores(R):
    """s_i = sum_t r[i,t]."""
    return [sum(row) for row in R]


def group_mean_std(s, uids):
    """Per response (mu_g, sigma_g): group mean and unbiased std; a group of one gets mu=0, sigma=1."""
    mu = [0.0] * len(s)
    sd = [1.0] * len(s)
    for members in groups_of(uids).values():
        k = len(members)
        if k == 1:
            continue
        mean = sum(s[j] for j in members) / k
        var = sum((s[j] - mean) ** 2 for j in members) / (k - 1)
        for j in members:
            mu[j] = mean
            sd[j] = math.sqrt(var)
    return mu, sd


def grpo(R, uids, norm_by_std=True):
    s = scores(R)
    mu, sd = group_mean_std(s, uids)
    if norm_by_std:
        return [(s[i] - mu[i]) / (sd[i] + 1e-6) for i in range(len(s))]
    return [s[i] - mu[i] for i in range(len(s))]


def rloo(R, uids):
    s = scores(R)
    out = [0.0] * len(s)
    for members in groups_of(uids).values():
        k = len(members)
        for i in members:
            if k == 1:
                out[i] = s[i]
            else:
                others = [s[j] for j in members if j != i]
                out[i] = s[i] - sum(others) / (k - 1)
    return out


def reinforce_pp_returns(R, M, gamma):
    """Backwards from run = 0: where m[t] = 1, run = r[t] + gamma * run and G[t] = run; where m[t] = 0 (padding or
    an observation span inside the response), G[t] = 0 and run passes through unchanged."""
    G = []
    for r, m in zip(R, M):
        L = len(r)
        g = [0.0] * L
        run = 0.0
        for t in range(L - 1, -1, -1):
            if m[t]:
                run = r[t] + gamma * run
                g[t] = run
        G.append(g)
    return G


def reinforce_pp_returns_old(R, M, gamma):
    """The earlier rule (run reset at every m = 0): kept to show right-padded masks give the same numbers."""
    G = []
    for r, m in zip(R, M):
        L = len(r)
        g = [0.0] * L
        nxt = 0.0  # m[t+1] * G[t+1]
        for t in range(L - 1, -1, -1):
            g[t] = r[t] + gamma * nxt
            nxt = m[t] * g[t]
        G.append(g)
    return G


def reinforce_pp(R, M, gamma):
    G = reinforce_pp_returns(R, M, gamma)
    W = masked_whiten(G, M)
    adv = [[W[i][t] * M[i][t] for t in range(len(M[i]))] for i in range(len(M))]
    return adv, G


def reinforce_pp_baseline(R, M, uids):
    s = scores(R)
    mu, _ = group_mean_std(s, uids)
    a = [[(s[i] - mu[i]) * M[i][t] for t in range(len(M[i]))] for i in range(len(M))]
    W = masked_whiten(a, M)
    return [[W[i][t] * M[i][t] for t in range(len(M[i]))] for i in range(len(M))]


def remax(R, M, baselines):
    adv, ret = [], []
    for r, m, b in zip(R, M, baselines):
        L = len(r)
        g = [0.0] * L
        acc = 0.0
        for t in range(L - 1, -1, -1):
            acc += r[t] * m[t]
            g[t] = acc
        ret.append(g)
        adv.append([g[t] - b * m[t] for t in range(L)])
    return adv, ret


def gpg(R, uids):
    s = scores(R)
    mu, _ = group_mean_std(s, uids)
    B = len(s)
    centred = [s[i] - mu[i] for i in range(B)]
    M = sum(1 for c in centred if abs(c) < 1e-6)
    alpha = B / max(B - M, 1)
    return [alpha * c for c in centred]


def opo(R, M, uids):
    s = scores(R)
    lens = [sum(m) for m in M]
    out = [0.0] * len(s)
    for members in groups_of(uids).values():
        if len(members) == 1:
            b = 0.0
        else:
            num = sum(lens[j] * s[j] for j in members)
            den = sum(lens[j] for j in members)
            b = num / den if den > 0 else 0.0
        for i in members:
            out[i] = s[i] - b
    return out


def grpo_passk(R, uids, norm_by_std=True):
    s = scores(R)
    _, sd = group_mean_std(s, uids)
    out = [0.0] * len(s)
    for members in groups_of(uids).values():
        assert len(members) >= 2
        best = members[0]
        for j in members[1:]:
            if s[j] > s[best]:  # strict: the first one wins ties
                best = j
        rest = [s[j] for j in members if j != best]
        gap = s[best] - max(rest)
        out[best] = gap / (sd[best] + 1e-6) if norm_by_std else gap
    return out


def gae(R, M, V, gamma, lam):
    """Returns (A_raw, returns); advantages = masked_whiten(A_raw, M) (compare where m=1)."""
    A_raw, RET = [], []
    for r, m, v in zip(R, M, V):
        L = len(r)
        a = [0.0] * L
        next_value = 0.0
        last = 0.0
        for t in range(L - 1, -1, -1):
            if m[t]:
                delta = r[t] + gamma * next_value - v[t]
                last = delta + gamma * lam * last
                next_value = v[t]
            a[t] = last
        A_raw.append(a)
        RET.append([a[t] + v[t] for t in range(L)])
    return A_raw, RET


def broadcast(per_response, M):
    """Outcome estimators: A_i * m[i,t]."""
    return [[per_response[i] * M[i][t] for t in range(len(M[i]))] for i in range(len(M))]


# ----------------------------------------------------------------------------- aggregation


def agg(LM, M, mode, C=None, T=None, S=None):
    """The five loss_agg_mode formulas; T / S default to this batch's counts (whole mini-batch)."""
    if T is None:
        T = sum(flat(M))
    if S is None:
        S = sum(1 for row in M if sum(row) > 0)
    if mode == "token-mean":
        total = sum(l * m for l, m in zip(flat(LM), flat(M)))
        return total / T if T > 0 else 0.0
    if mode == "token-sum":  # no normaliser at all
        return sum(l * m for l, m in zip(flat(LM), flat(M)))
    if mode == "seq-mean-token-sum":
        total = sum(l * m for l, m in zip(flat(LM), flat(M)))
        return total / S if S > 0 else 0.0
    if mode == "seq-mean-token-mean":
        total = 0.0
        for lrow, mrow in zip(LM, M):
            total += sum(l * m for l, m in zip(lrow, mrow)) / (sum(mrow) + 1e-8)
        return total / S if S > 0 else 0.0
    if mode == "seq-mean-token-sum-norm":
        total = sum(l * m for l, m in zip(flat(LM), flat(M)))
        return total / (S * C) if S > 0 else 0.0
    raise ValueError(mode)


# ----------------------------------------------------------------------------- policy / value losses


def vanilla_token(lp, old, A, eps_low, eps_high, c):
    """Returns (loss, l1, l2, lc, delta) of one token."""
    delta = clamp(lp - old, -20.0, 20.0)
    ratio = math.exp(delta)
    l1 = -A * ratio
    l2 = -A * clamp(ratio, 1 - eps_low, 1 + eps_high)
    lc = max(l1, l2)
    loss = min(lc, -A * c) if A < 0 else lc
    return loss, l1, l2, lc, delta


def vanilla(LP, OLD, ADV, M, mode, eps_low=0.2, eps_high=0.2, c=3.0, C=None):
    Lm, clip, kl, lower = [], [], [], []
    for i in range(len(M)):
        row = []
        for t in range(len(M[i])):
            A = ADV[i][t]
            loss, l1, l2, lc, delta = vanilla_token(LP[i][t], OLD[i][t], A, eps_low, eps_high, c)
            row.append(loss)
            clip.append(1.0 if l2 > l1 else 0.0)
            kl.append(-delta)
            lower.append(1.0 if (lc > -A * c and A < 0) else 0.0)
        Lm.append(row)
    ms = flat(M)
    metrics = {"actor/pg_clipfrac": masked_mean(clip, ms), "actor/ppo_kl": masked_mean(kl, ms),
               "actor/pg_clipfrac_lower": masked_mean(lower, ms)}
    return agg(Lm, M, mode, C), metrics


def gpg_loss(LP, ADV, M, mode, C=None):
    Lm = [[-LP[i][t] * ADV[i][t] for t in range(len(M[i]))] for i in range(len(M))]
    return agg(Lm, M, mode, C)


def gspo(LP, OLD, ADV, M, eps_low=0.2, eps_high=0.2):
    """Value of the GSPO loss (sg(.) does not change values, so s = exp(min(lr_i, 10)))."""
    Lm = []
    for i in range(len(M)):
        n = sum(M[i])
        lr = sum((LP[i][t] - OLD[i][t]) * M[i][t] for t in range(len(M[i]))) / max(n, 1)
        s = math.exp(min(lr, 10.0))
        row = []
        for t in range(len(M[i])):
            A = ADV[i][t]
            row.append(max(-A * s, -A * clamp(s, 1 - eps_low, 1 + eps_high)))
        Lm.append(row)
    return agg(Lm, M, "seq-mean-token-mean")


def cispo(LP, OLD, ADV, M, mode, eps_low=0.2, eps_high=0.2, C=None):
    Lm = []
    for i in range(len(M)):
        row = []
        for t in range(len(M[i])):
            ratio = math.exp(clamp(LP[i][t] - OLD[i][t], -20.0, 20.0))
            w = clamp(ratio, 1 - eps_low, 1 + eps_high)
            row.append(-w * ADV[i][t] * LP[i][t])
        Lm.append(row)
    return agg(Lm, M, mode, C)


def value_loss(VP, VOLD, RET, M, cliprange, mode, C=None):
    Lm, frac = [], []
    for i in range(len(M)):
        row = []
        for t in range(len(M[i])):
            v, vo, R = VP[i][t], VOLD[i][t], RET[i][t]
            vc = clamp(v, vo - cliprange, vo + cliprange)
            a, b = (v - R) ** 2, (vc - R) ** 2
            row.append(max(a, b))
            frac.append(1.0 if b > a else 0.0)
        Lm.append(row)
    return 0.5 * agg(Lm, M, mode, C), masked_mean(frac, flat(M))


# ----------------------------------------------------------------------------- KL


def kl_value(d, kind):
    base = kind[:-1] if kind.endswith("+") else kind
    if base in ("kl", "k1"):
        return d
    if base == "abs":
        return abs(d)
    if base in ("mse", "k2"):
        return 0.5 * d * d
    if base in ("low_var_kl", "k3"):
        x = clamp(-d, -20.0, 20.0)
        return clamp(math.exp(x) - x - 1.0, -10.0, 10.0)
    raise KeyError(kind)


# ----------------------------------------------------------------------------- random batches


def random_layout(rng: random.Random, n_groups: int, max_group: int, allow_single: bool = True):
    """Shuffled string uids for groups of varied size (some of one when allowed)."""
    uids = []
    lo = 1 if allow_single else 2
    for g in range(n_groups):
        size = rng.randint(lo, max_group)
        uid = f"prompt-{rng.randrange(10**6)}-{g}"
        uids += [uid] * size
    rng.shuffle(uids)
    return uids


def random_mask(rng: random.Random, B: int, L: int, holes: bool = True, zero_rows: bool = True):
    """Right-padded response masks, with holes (tool tokens) and some zero-length responses."""
    M = []
    for _ in range(B):
        n = rng.randint(0 if zero_rows else 1, L)
        row = [1.0] * n + [0.0] * (L - n)
        if holes and n > 2:
            for t in range(1, n - 1):
                if rng.random() < 0.25:
                    row[t] = 0.0
        M.append(row)
    if not any(flat(M)):
        M[0][0] = 1.0
    return M


MULTI_TURN_FIRST_ROW = [1.0, 1.0, 0.0, 0.0, 0.0, 1.0, 1.0]  # policy, a run of appended tokens, policy; then padding


def multi_turn_mask(rng: random.Random, B: int, L: int):
    """Response masks of multi-turn episodes (width at least 8): each row is policy turns (runs of 1s) separated by
    appended tokens (runs of 0s: tool results, template glue), then right padding; some rows end with appended
    tokens, so their last policy token is not their last real token. The first row is MULTI_TURN_FIRST_ROW."""
    L = max(L, len(MULTI_TURN_FIRST_ROW) + 1)
    M = [MULTI_TURN_FIRST_ROW + [0.0] * (L - len(MULTI_TURN_FIRST_ROW))]
    for _ in range(B - 1):
        row = []
        while len(row) < L:
            row += [1.0] * rng.randint(1, 3)
            if rng.random() < 0.3:
                break  # the episode ended on a policy turn
            row += [0.0] * rng.randint(1, 3)
            if rng.random() < 0.3:
                break  # ... or with appended tokens after its last turn (a truncated episode)
        M.append(row[:L] + [0.0] * (L - len(row)))
    return M


LAYOUTS = ("holes", "multi_turn")


def layout_mask(rng: random.Random, B: int, L: int, layout: str, **kwargs):
    """`random_mask` (scattered holes, zero-length rows) or `multi_turn_mask` (runs of appended tokens); the
    multi-turn one may be wider than L: callers size the other inputs by `len(M[0])`."""
    if layout == "multi_turn":
        return multi_turn_mask(rng, B, L)
    return random_mask(rng, B, L, **kwargs)


def outcome_rewards(rng: random.Random, M, binary: bool):
    """Whole score on the last real response token; zero-length responses score 0."""
    R = []
    for row in M:
        r = [0.0] * len(row)
        valid = [t for t, m in enumerate(row) if m]
        if valid:
            r[valid[-1]] = float(rng.randint(0, 1)) if binary else rng.uniform(-2.0, 3.0)
        R.append(r)
    return R


# ----------------------------------------------------------------------------- newer policy losses


def token_cov(LP, ADV, M):
    """(A - mean A)(logp - mean logp) per token, means over the valid tokens."""
    ms = flat(M)
    ma, ml = masked_mean(flat(ADV), ms), masked_mean(flat(LP), ms)
    return [[(ADV[i][t] - ma) * (LP[i][t] - ml) for t in range(len(M[i]))] for i in range(len(M))]


def clip_cov_candidates(LP, OLD, ADV, M, lo, hi, lb, ub):
    """Valid tokens PPO did not clip whose covariance lies strictly inside (lb, ub)."""
    cov = token_cov(LP, ADV, M)
    out = []
    for i in range(len(M)):
        for t in range(len(M[i])):
            _, l1, l2, _, _ = vanilla_token(LP[i][t], OLD[i][t], ADV[i][t], lo, hi, 3.0)
            if M[i][t] and not l2 > l1 and lb < cov[i][t] < ub:
                out.append((i, t))
    return out


def clip_cov(LP, OLD, ADV, M, mode, lo, hi, dropped, C=None):
    """max(l1, l2) (no dual clip), zero on the `dropped` tokens."""
    Lm = []
    for i in range(len(M)):
        row = []
        for t in range(len(M[i])):
            _, l1, l2, _, _ = vanilla_token(LP[i][t], OLD[i][t], ADV[i][t], lo, hi, 3.0)
            row.append(0.0 if (i, t) in dropped else max(l1, l2))
        Lm.append(row)
    return agg(Lm, M, mode, C)


def kl_cov(LP, OLD, ADV, M, mode, ratio, coef, C=None):
    cov = token_cov(LP, ADV, M)
    valid = [(cov[i][t], i, t) for i in range(len(M)) for t in range(len(M[i])) if M[i][t]]
    k = max(1, int(len(valid) * ratio))
    top = {(i, t) for _, i, t in sorted(valid, reverse=True)[:k]}
    Lm = []
    for i in range(len(M)):
        row = []
        for t in range(len(M[i])):
            d = clamp(LP[i][t] - OLD[i][t], -20.0, 20.0)
            loss = -ADV[i][t] * math.exp(d)
            if (i, t) in top:
                loss += coef * abs(d)
            row.append(loss)
        Lm.append(row)
    return agg(Lm, M, mode, C)


def sapo(LP, OLD, ADV, M, tau_pos=1.0, tau_neg=1.05):
    Lm = []
    for i in range(len(M)):
        row = []
        for t in range(len(M[i])):
            r = math.exp(clamp(LP[i][t] - OLD[i][t], -20.0, 20.0))
            A = ADV[i][t]
            tau = tau_pos if A > 0 else tau_neg
            gate = 4.0 / tau / (1.0 + math.exp(-tau * (r - 1.0)))
            row.append(-gate * A)
        Lm.append(row)
    return agg(Lm, M, "seq-mean-token-mean")


def geo_mean(LP, OLD, ADV, M, lo, hi, W=None):
    """Per sequence: -mean(A) * exp(mean of the sign-aware clipped log-ratios); mean over non-empty sequences."""
    total, S = 0.0, 0
    for i in range(len(M)):
        n = sum(M[i])
        if n == 0:
            continue
        S += 1
        s_d, s_a, s_w = 0.0, 0.0, 0.0
        for t in range(len(M[i])):
            if not M[i][t]:
                continue
            d, A = LP[i][t] - OLD[i][t], ADV[i][t]
            dc = clamp(d, -lo, hi)
            if A > 0:
                d = min(d, dc)
            elif A < 0:
                d = max(d, dc)
            else:
                d = 0.0
            s_d += d
            s_a += A
            if W is not None:
                s_w += math.log(max(W[i][t], 1e-10))
        k = n + 1e-8  # the means divide by len + 1e-8
        loss = -(s_a / k) * math.exp(s_d / k)
        if W is not None:
            loss *= math.exp(s_w / k)
        total += loss
    return total / S if S else 0.0


def dppo_keep(lp, old, A, lo, hi, kind):
    p, q = math.exp(lp), math.exp(old)
    if kind == "tv":
        return (p - q <= hi) if A > 0 else (p - q >= -lo)
    kl = q * (old - lp) + (1 - q) * math.log((1 - q + 1e-8) / (1 - p + 1e-8))
    return (kl <= hi or p <= q) if A > 0 else (kl <= lo or p >= q)


def dppo(LP, OLD, ADV, M, mode, lo, hi, c, kind, C=None):
    """-A * min(ratio, c) * logp on the kept tokens (value; the ratio is a constant for the gradient)."""
    Lm = []
    for i in range(len(M)):
        row = []
        for t in range(len(M[i])):
            lp, old, A = LP[i][t], OLD[i][t], ADV[i][t]
            keep = dppo_keep(lp, old, A, lo, hi, kind)
            r = math.exp(clamp(lp - old, -20.0, 20.0))
            row.append(-A * min(r, c) * lp if keep else 0.0)
        Lm.append(row)
    return agg(Lm, M, mode, C)


# ----------------------------------------------------------------------------- newer estimators


def optimal_token_baseline(R, M, uids, OLDLP, SPS, W=None):
    """G = return-to-go of r*m; per group and t: B_t = sum_j G W m / (sum_j W m + 1e-8) with
    W_jt = sum_{s<=t} (1 - 2 exp(oldlp) + sum_pi^2) [* w^2] * m (group of one: B = 0), and B = 0 from column
    len_2 on for a group's one longest response (len = sum of its mask, len_2 the group's second longest: verl's
    handle_zero_tail); A = (G - B) * m."""
    B_, L = len(R), len(R[0])
    G, Wc = [], []
    for i in range(B_):
        g, acc = [0.0] * L, 0.0
        for t in range(L - 1, -1, -1):
            acc += R[i][t] * M[i][t]
            g[t] = acc
        G.append(g)
        w, run = [0.0] * L, 0.0
        for t in range(L):
            x = 1 - 2 * math.exp(OLDLP[i][t]) + SPS[i][t]
            if W is not None:
                x *= W[i][t] ** 2
            run += x * M[i][t]
            w[t] = run * M[i][t]
        Wc.append(w)
    A = [[0.0] * L for _ in range(B_)]
    for members in groups_of(uids).values():
        lens = {j: int(sum(M[j])) for j in members}
        ranked = sorted(lens.values(), reverse=True)
        tail = None  # (the one longest response, the column its baseline is 0 from)
        if len(members) > 1 and ranked[0] > ranked[1]:
            tail = (next(j for j in members if lens[j] == ranked[0]), ranked[1])
        for t in range(L):
            if len(members) > 1:
                num = sum(G[j][t] * Wc[j][t] * M[j][t] for j in members)
                den = sum(Wc[j][t] * M[j][t] for j in members) + 1e-8
                b = num / den
            else:
                b = 0.0
            for j in members:
                bj = 0.0 if tail is not None and j == tail[0] and t >= tail[1] else b
                A[j][t] = (G[j][t] - bj) * M[j][t]
    return A, G


def gdpo(COMPS, M, uids, weights=None, norm_by_std=True):
    """Each component group-normalised as grpo normalises scores, weighted sum, broadcast, whitened, masked."""
    K = len(COMPS[0])
    weights = weights or [1.0] * K
    total = [0.0] * len(COMPS)
    for k in range(K):
        s = [row[k] for row in COMPS]
        mu, sd = group_mean_std(s, uids)
        for i in range(len(s)):
            total[i] += weights[k] * ((s[i] - mu[i]) / (sd[i] + 1e-6) if norm_by_std else s[i] - mu[i])
    X = broadcast(total, M)
    Wh = masked_whiten(X, M)
    return [[Wh[i][t] * M[i][t] for t in range(len(M[i]))] for i in range(len(M))]


# ----------------------------------------------------------------------------- rollout correction


def rollout_is_weights(OLD, ROLL, M, level, threshold, normalize=False, mode="truncate"):
    """min(rho, threshold) (`truncate`), or rho where rho <= threshold and 0 above (`mask`)."""
    B_, L = len(M), len(M[0])
    rho = [[0.0] * L for _ in range(B_)]
    for i in range(B_):
        if level == "token":
            for t in range(L):
                rho[i][t] = math.exp(clamp((OLD[i][t] - ROLL[i][t]) * M[i][t], -20.0, 20.0)) * M[i][t]
        else:
            s = sum((OLD[i][t] - ROLL[i][t]) * M[i][t] for t in range(L))
            for t in range(L):
                rho[i][t] = math.exp(clamp(s, -20.0, 20.0)) * M[i][t]
    if mode == "truncate":
        w = [[min(x, threshold) for x in row] for row in rho]
    else:
        w = [[x if x <= threshold else 0.0 for x in row] for row in rho]
    if normalize:
        if level == "token":
            mean = masked_mean(flat(w), flat(M))
        else:
            seq = [w[i][next(t for t in range(L) if M[i][t])] for i in range(B_) if any(M[i])]
            mean = sum(seq) / len(seq)
        w = [[x / mean for x in row] for row in w]
    return w


def rollout_rejection_keep(OLD, ROLL, M, specs):
    """Rejection sampling, written out: specs [(option, lower, upper)]; per token d = log(old / rollout) clamped to
    +-20, k1 = -d, k2 = d^2 / 2, k3 = e^d - 1 - d; a token option judges each token, seq_sum / seq_mean / seq_max
    the sum / mean / max over the response's tokens; k1 must lie in [log lower, log upper], others <= upper.
    Returns the keep mask times M (a token is kept if every option keeps it)."""
    B_, L = len(M), len(M[0])
    keep = [[float(M[i][t]) for t in range(L)] for i in range(B_)]
    for name, lower, upper in specs:
        for i in range(B_):
            toks = []
            for t in range(L):
                d = clamp(OLD[i][t] - ROLL[i][t], -20.0, 20.0)
                toks.append({"k1": -d, "k2": 0.5 * d * d, "k3": math.exp(d) - 1.0 - d}[name[-2:]])
            valid = [toks[t] for t in range(L) if M[i][t]]
            if name.startswith("seq_sum"):
                stats = [sum(valid)] * L
            elif name.startswith("seq_mean"):
                stats = [sum(valid) / len(valid) if valid else 0.0] * L
            elif name.startswith("seq_max"):
                stats = [max(valid) if valid else 0.0] * L
            else:
                stats = toks
            for t in range(L):
                if name.endswith("k1"):
                    ok = math.log(lower) <= stats[t] <= math.log(upper)
                else:
                    ok = stats[t] <= upper
                if not ok:
                    keep[i][t] = 0.0
    return keep


# ----------------------------------------------------------------------------- asynchronous RL


def decoupled_ppo(LP, PROX, BEHAV, ADV, M, mode, level="token", cap=2.0, cap_mode="truncate", eps_low=0.2,
                  eps_high=0.2, c=3.0, C=None):
    """Decoupled PPO (Hilton et al. 2021; AReaL): per token, the behaviour weight w = pi_prox / pi_behav (capped:
    truncated at `cap`, or 0 above it), times PPO's dual-clipped surrogate of r = pi / pi_prox; then agg.
    Returns (loss, d loss / d LP) with the gradient written out: w * (-A r) where the unclipped term is the
    active one, 0 where a clip binds."""
    W = rollout_is_weights(PROX, BEHAV, M, level, cap, mode=cap_mode)
    B_, L = len(M), len(M[0])
    Lm = [[0.0] * L for _ in range(B_)]
    G = [[0.0] * L for _ in range(B_)]
    for i in range(B_):
        for t in range(L):
            A = ADV[i][t]
            loss, l1, l2, lc, delta = vanilla_token(LP[i][t], PROX[i][t], A, eps_low, eps_high, c)
            Lm[i][t] = W[i][t] * loss
            dual = A < 0 and lc > -A * c
            G[i][t] = 0.0 if dual or l2 > l1 else W[i][t] * (-A * math.exp(delta))
    # agg is linear in the token losses: its coefficient of token (i, t) is agg of the indicator of (i, t)
    grad = [[0.0] * L for _ in range(B_)]
    for i in range(B_):
        for t in range(L):
            if M[i][t]:
                E = [[1.0 if (a, b) == (i, t) else 0.0 for b in range(L)] for a in range(B_)]
                grad[i][t] = G[i][t] * agg(E, M, mode, C)
    return agg(Lm, M, mode, C), grad


def staleness(VERSIONS, M, trainer_version):
    """Mean, max and the shares at most 0, 1, 2, 4, 8 versions old of the policy tokens' staleness."""
    s = [trainer_version - v for v, m in zip(flat(VERSIONS), flat(M)) if m]
    if not s:
        return {}
    out = {"async/staleness_mean": sum(s) / len(s), "async/staleness_max": float(max(s))}
    for k in (0, 1, 2, 4, 8):
        out[f"async/staleness_le_{k}"] = sum(1 for x in s if x <= k) / len(s)
    return out


# ----------------------------------------------------------------------------- on-policy distillation


def log_softmax(z):
    top = max(z)
    lse = top + math.log(sum(math.exp(v - top) for v in z))
    return [v - lse for v in z]


def teacher_topk(teacher_logits, k):
    """The teacher's k most likely token ids (ties: the lower id first) and their log-probs."""
    lp = log_softmax(teacher_logits)
    ids = sorted(range(len(lp)), key=lambda v: (-lp[v], v))[:k]
    return ids, [lp[v] for v in ids]


def forward_kl_topk(student_logits, ids, teacher_lp, min_clamp=None):
    """sum over the teacher's top-k of p_T (log p_T - log p_S), the student's log-probs from its softmax over the
    whole vocabulary (no renormalisation over the k tokens), clamped at 0; with the masses of both on the k tokens."""
    s_all = log_softmax(student_logits)
    s = [s_all[v] for v in ids]
    s_mass, t_mass = sum(math.exp(v) for v in s), sum(math.exp(v) for v in teacher_lp)
    if min_clamp is not None:
        s, t = [max(v, min_clamp) for v in s], [max(v, min_clamp) for v in teacher_lp]
    else:
        t = list(teacher_lp)
    kl = sum(math.exp(tv) * (tv - sv) for tv, sv in zip(t, s))
    return max(kl, 0.0), s_mass, t_mass


def forward_kl_topk_grad(student_logits, ids, teacher_lp):
    """d/dz_j of sum_v p_T(v) (log p_T(v) - log p_S(v)) (no clamp active): p_S(j) * M_T - p_T(j) [j in top-k]."""
    p = [math.exp(v) for v in log_softmax(student_logits)]
    m_t = sum(math.exp(v) for v in teacher_lp)
    pt = dict(zip(ids, (math.exp(v) for v in teacher_lp)))
    return [p[j] * m_t - pt.get(j, 0.0) for j in range(len(p))]
