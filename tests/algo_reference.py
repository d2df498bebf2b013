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


def entropy(z):
    """logsumexp(z) - sum(softmax(z) * z) for one vector of logits."""
    zmax = max(z)
    total = 0.0
    for v in z:
        total += math.exp(v - zmax)
    lse = zmax + math.log(total)
    h = lse
    for v in z:
        p = math.exp(v - lse)
        h -= p * v
    return h


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
    """G[t] = r[t] + gamma * m[t+1] * G[t+1], backwards, G[L] = 0."""
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
    """The four loss_agg_mode formulas; T / S default to this batch's counts (whole mini-batch)."""
    if T is None:
        T = sum(flat(M))
    if S is None:
        S = sum(1 for row in M if sum(row) > 0)
    if mode == "token-mean":
        total = sum(l * m for l, m in zip(flat(LM), flat(M)))
        return total / T if T > 0 else 0.0
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
