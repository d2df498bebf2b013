"""`rollout.*` (the generating group of processes) and `async_training.*`: asynchronous RL, where some processes
generate and score while the others train (docs/architecture.md, "Asynchronous RL")."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class RolloutGroupConfig:
    nnodes: int = 1
    """nodes of the generating group (only 1 is built: `posttrain train` starts both groups on one node)"""
    n_gpus_per_node: int = 0
    """processes that only generate and score, beside the `trainer.n_gpus_per_node` that train; 0 = none: every
    process generates and trains in turn (synchronous RL). > 0 turns on asynchronous RL (`async_training.*`);
    built: 1 generating process beside 1 training process"""


@dataclass
class AsyncTrainingConfig:
    staleness_threshold: float = 1.0
    """with `rollout.n_gpus_per_node` > 0: how many versions old the weights that sample a batch may be when it
    trains (batch k waits for weights of version >= k-1-N, and takes the newest). 0 = the two groups take turns
    (synchronous, staleness 0); 1 = one-step-off-policy: the batch of step k+1 is generated while step k trains
    (staleness 1). Whole numbers only (verl's fractions of a batch need streaming generation, not built)"""
    partial_rollout: bool = False
    """True: weights pushed while a batch generates are swapped in between two decoding steps, so the responses in
    flight go on with the new weights (their earlier tokens' keys and values stay those of the old ones); each token
    keeps the version that sampled it (`rollout_versions`) and its behaviour log-prob. False: a batch is generated
    with the weights it started with. Not with `rollout.multi_turn.enable` nor LoRA"""
    trigger_parameter_sync_step: int = 1
    """updates between two weight pushes to the generating group: only 1 is built"""
    require_batches: int = 1
    """mini-batches the trainer takes at once: only 1 is built (the trainer takes the whole step's batch)"""
    wait_timeout_s: float = 1800.0
    """the longest any process waits for the other group (a batch, a weight push) before the run stops with an
    error; a process that dies stops the run at once"""
