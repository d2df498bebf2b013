"""How stale a batch is: per policy token, the trainer's weight version minus the token's version — with partial
rollouts the oldest version among the keys and values the token attended to (its prompt's), which can be older than
the weights that sampled it (docs/algorithms.md, "Asynchronous RL").

Asynchronous runs sample with weights some optimizer steps behind the trainer; these metrics say how far behind,
so a run can check its staleness bound and read the decoupled objective's weights against it.
"""

from __future__ import annotations

from torch import Tensor

STALENESS_BUCKETS = (0, 1, 2, 4, 8)  # async/staleness_le_{k}: the share of policy tokens at most k versions old


def staleness_metrics(rollout_versions: Tensor, response_mask: Tensor, trainer_version: int) -> dict[str, float]:
    """`async/staleness_mean`, `_max` and the shares `async/staleness_le_{0,1,2,4,8}` over the tokens where
    `response_mask` is 1; empty when there is none. A version newer than the trainer's is an error (the batch's
    versions and the trainer's counter disagree)."""
    if rollout_versions.shape != response_mask.shape:
        raise ValueError(f"rollout_versions {tuple(rollout_versions.shape)} and response_mask "
                         f"{tuple(response_mask.shape)} differ in shape")
    keep = response_mask.bool()
    if not keep.any():
        return {}
    staleness = int(trainer_version) - rollout_versions[keep].long()
    if int(staleness.min()) < 0:
        raise ValueError(f"a token was sampled with weight version {int(rollout_versions[keep].max())}, newer than "
                         f"the trainer's version {int(trainer_version)}")
    s = staleness.double()
    return {"async/staleness_mean": float(s.mean()), "async/staleness_max": float(s.max()),
            **{f"async/staleness_le_{k}": float((s <= k).double().mean()) for k in STALENESS_BUCKETS}}
