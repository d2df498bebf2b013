"""`algorithm.*`: the advantage estimator, the KL in the reward, DAPO group filtering, rollout correction."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Union


@dataclass
class KLCtrlConfig:
    type: str = "fixed"
    """beta and its controller"""
    kl_coef: float = 0.001
    """beta and its controller"""
    horizon: int = 10000
    """beta and its controller"""
    target_kl: float = 0.1
    """beta and its controller"""


@dataclass
class FilterGroupsConfig:
    enable: bool = False
    """DAPO dynamic sampling"""
    metric: Optional[str] = None
    """DAPO dynamic sampling: a group is kept when this differs among its responses: `score` / `acc` (the scorer's
    own, before overlong shaping), `seq_reward` (summed token-level scores, shaping included), `seq_final_reward`
    (summed token-level rewards, the in-reward KL penalty subtracted); see docs/algorithms.md"""
    max_num_gen_batches: int = 0
    """DAPO dynamic sampling"""


@dataclass
class RolloutCorrectionConfig:
    rollout_is: Optional[str] = None
    """truncated importance sampling `pi_old / pi_rollout`: `token` or `sequence` (null = off); `token` is the
    switch of the decoupled objective for asynchronous RL (docs/algorithms.md)"""
    rollout_is_threshold: Union[float, str] = 2.0
    """upper truncation of the weights (`.inf`: none), or a range `lower_upper` such as `0.5_4.0` (verl's IcePop:
    weights outside [lower, upper] are masked to 0, whatever `rollout_is_mode` says; lower <= 1 <= upper)"""
    rollout_is_mode: str = "truncate"
    """what a weight above `rollout_is_threshold` becomes: `truncate` (the threshold) or `mask` (0: the token, or
    with `sequence` the response, leaves the loss but stays in its normaliser, as AReaL's `behav_imp_weight_cap`;
    threshold >= 1). Not verl's former `mask` mode, which also masked below 1/threshold"""
    rollout_rs: Optional[str] = None
    """rejection sampling (null = off): comma-separated `token_k1|k2|k3`, `seq_sum_k1|k2|k3`, `seq_mean_k1|k2|k3`,
    `seq_max_k2|k3`; a token (`token_*`) or response (`seq_*`) whose divergence between old and rollout policy is
    out of bounds leaves the response mask (advantages, losses, normalisers), as verl; with `bypass_mode`, judged
    in the policy loss against the current policy (rejected tokens leave that loss, not its normaliser). verl's
    former levels `token` / `sequence` / `geometric` (ratio bounds `rollout_rs_threshold_lower` to
    `rollout_rs_threshold`) are read as `token_k1` / `seq_sum_k1` / `seq_mean_k1`"""
    rollout_rs_threshold: Any = None
    """bounds of `rollout_rs`: one for all options or one per option (comma-separated); a `k1` option takes a ratio
    range `lower_upper` such as `0.6_1.6` (u alone: 1/u to u), the others an upper bound"""
    rollout_rs_threshold_lower: Optional[float] = None
    """verl's former lower ratio bound of `rollout_rs=token|sequence|geometric` (null = 1 / rollout_rs_threshold);
    today's `k1` options take the range in `rollout_rs_threshold`"""
    rollout_token_veto_threshold: Optional[float] = None
    """verl's former per-token veto (null = off): a response with any token whose pi_old / pi_rollout is below this
    leaves the response mask whole (with `bypass_mode`, judged in the loss against the current policy)"""
    bypass_mode: bool = False
    """True: the rollout's log-probs are the old policy (no old-log-prob pass); not with `rollout_is`"""
    loss_type: str = "ppo_clip"
    """bypass mode's loss: `ppo_clip` (the configured policy loss on pi / pi_rollout) or `reinforce` (REINFORCE with
    explicit weights `-A * logp * sg(pi / pi_rollout)` from `rollout_is`, no clip; docs/algorithms.md)"""
    rollout_is_batch_normalize: bool = False
    """rescale the weights to mean 1 over the batch"""


@dataclass
class AlgorithmConfig:
    adv_estimator: str = "gae"
    """`gae`, `grpo`, `rloo`, `reinforce_plus_plus`, `reinforce_plus_plus_baseline`, `remax`, `gpg`, `opo`,
    `grpo_passk`, `optimal_token_baseline`, `tir_optimal_token_baseline`, `gdpo`, `grpo_vectorized` /
    `rloo_vectorized` (= `grpo` / `rloo`), or registered"""
    gamma: float = 1.0
    """discount and GAE lambda"""
    lam: float = 1.0
    """discount and GAE lambda"""
    norm_adv_by_std_in_grpo: bool = True
    """False = Dr. GRPO"""
    use_kl_in_reward: bool = False
    """`r = score - beta * kl(old, ref)` (loads the reference)"""
    kl_penalty: str = "kl"
    """estimator of the in-reward KL"""
    kl_ctrl: KLCtrlConfig = field(default_factory=KLCtrlConfig)
    filter_groups: FilterGroupsConfig = field(default_factory=FilterGroupsConfig)
    gdpo_reward_keys: Optional[list] = None
    """`gdpo`: the keys of the reward function's dict, one reward component each (required)"""
    gdpo_reward_weights: Optional[list] = None
    """`gdpo`: a weight per component (null = 1 each)"""
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)
