"""Metric computations with the names users already chart (ALGORITHMS.md, Metric names / Validation metrics)."""

from __future__ import annotations

import time
from collections import Counter, defaultdict
from math import comb

import torch

from ..algo import group_ids
from ..data.batch import response_attention


def _stats(prefix: str, values: torch.Tensor) -> dict[str, float]:
    if values.numel() == 0:
        return {}
    return {f"{prefix}/mean": float(values.mean()), f"{prefix}/max": float(values.max()), f"{prefix}/min": float(values.min())}


def data_metrics(batch, max_response_length: int) -> dict[str, float]:
    """critic/score, critic/rewards, critic/advantages, critic/returns, critic/values (over policy tokens),
    lengths (every response token; multi-turn batches add the policy's share), zero-std groups."""
    mask = batch["response_mask"].bool()
    valid_rows = mask.any(-1)
    out = {}
    out |= _stats("critic/score", batch["token_level_scores"].sum(-1))
    out |= _stats("critic/rewards", batch["token_level_rewards"].sum(-1))
    out |= _stats("critic/advantages", batch["advantages"][mask])
    out |= _stats("critic/returns", batch["returns"][mask])
    if "values" in batch:
        out |= _stats("critic/values", batch["values"][mask])
    lengths = response_attention(batch).sum(-1).float()  # every token after the prompt, policy and appended
    out |= _stats("response_length", lengths)
    out["response_length/clip_ratio"] = float((lengths >= max_response_length).float().mean())
    if "response_attention_mask" in batch:  # multi-turn: how many of those tokens the policy wrote
        out["response_length/policy_tokens_mean"] = float(mask.sum(-1).float().mean())
    out |= _stats("prompt_length", batch["prompt_mask"].sum(-1).float())
    scores = batch["token_level_scores"].sum(-1)
    gid = group_ids(batch.meta["uid"])
    n_groups = int(gid.max()) + 1
    zero = sum(1 for g in range(n_groups) if float(scores[gid == g].std(unbiased=False)) < 1e-6)
    out["batch/zero_std_group_frac"] = zero / n_groups
    out["batch/valid_response_frac"] = float(valid_rows.float().mean())
    return out


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k = 1 - C(n-c, k) / C(n, k)."""
    if n - c < k:
        return 1.0
    return 1.0 - comb(n - c, k) / comb(n, k)


def reward_metrics(meta: dict) -> dict[str, float]:
    """reward/errors and reward/timeouts (counts), and reward/<key>/mean of every other numeric key a scorer
    returned (`reward:<key>` in the batch's meta), over the rows that returned it."""
    out = {}
    for key, values in meta.items():
        if not key.startswith("reward:") or key in ("reward:score", "reward:response_text"):
            continue
        name = key.split(":", 1)[1]
        if name in ("errors", "timeouts"):
            out[f"reward/{name}"] = sum(values)
        elif (present := [v for v in values if v is not None]) and all(isinstance(v, (int, float))
                                                                         for v in present):  # bools count too
            out[f"reward/{name}/mean"] = sum(present) / len(present)
    return out


class timer:
    """`with timer(timing, "gen"):` adds the block's wall time to timing["gen"]."""

    def __init__(self, store: dict, name: str):
        self.store, self.name = store, name

    def __enter__(self):
        self.t = time.perf_counter()

    def __exit__(self, *exc):
        self.store[self.name] = self.store.get(self.name, 0.0) + time.perf_counter() - self.t


def validation_metrics(data_sources: list[str], uids: list, scores: list[float], answers: list) -> dict[str, float]:
    """Per data source: mean@n, best@n, maj@n (vote on extracted answers), pass@k for k = 1, 2, 4, ..., n."""
    groups: dict[tuple, list[tuple[float, object]]] = defaultdict(list)
    for ds, uid, s, a in zip(data_sources, uids, scores, answers):
        groups[(ds, uid)].append((s, a))
    per_source: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for (ds, _), items in groups.items():
        n = len(items)
        s = [x[0] for x in items]
        correct = sum(1 for v in s if v > 0)
        m = per_source[ds]
        m[f"mean@{n}"].append(sum(s) / n)
        if n > 1:
            m[f"best@{n}"].append(max(s))
            votes = Counter(a for _, a in items if a is not None)
            if votes:
                top = votes.most_common(1)[0][0]
                m[f"maj@{n}"].append(next(v for v, a in items if a == top))
            else:
                m[f"maj@{n}"].append(0.0)
        k = 1
        while k <= n:
            m[f"pass@{k}"].append(pass_at_k(n, correct, k))
            k *= 2
    out = {}
    for ds, m in per_source.items():
        for name, values in m.items():
            section = "val-core" if name.startswith("mean@") else "val-aux"
            out[f"{section}/{ds}/acc/{name}"] = sum(values) / len(values)
    return out
