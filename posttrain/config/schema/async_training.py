"""`rollout.*` (the generating group of processes) and `async_training.*`: asynchronous RL, where some processes
generate and score while the others train (docs/architecture.md, "Asynchronous RL")."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass
class RolloutGroupConfig:
    nnodes: int = 1
    """nodes of the generating group (only 1 is built: `posttrain train` starts both groups on one node)"""
    n_gpus_per_node: int = 0
    """processes that only generate and score, beside the `trainer.n_gpus_per_node` that train; 0 = none: every
    process generates and trains in turn (synchronous RL). > 0 turns on asynchronous RL (`async_training.*`);
    built: 1 generating process beside the `trainer.n_gpus_per_node` training processes of one node (FSDP2 over
    them when more than 1)"""
    total_rollout_steps: Optional[int] = None
    """with `rollout.n_gpus_per_node` > 0: prompts to generate in all (verl's fully asynchronous count); when
    `trainer.total_training_steps` is unset the run trains total_rollout_steps // data.train_batch_size steps"""


@dataclass
class AsyncTrainingConfig:
    staleness_threshold: float = 1.0
    """with `rollout.n_gpus_per_node` > 0: how far generation may run ahead of the weights it holds, as a share of
    the batches trained between two weight pushes (verl's: at most (1 + threshold) x trigger_parameter_sync_step
    batches are generated per push). Batch k waits for weights of version >= k - floor((1 + threshold) x
    trigger_parameter_sync_step), and takes the newest; a step's batch is the unit (no streaming of single samples),
    so a fraction generates ahead only the whole batches it covers. With trigger_parameter_sync_step=1: 0 = the two
    groups take turns (staleness 0); 1 = one-step-off-policy (the batch of step k+1 is generated while step k
    trains); 0.1 = 0"""
    partial_rollout: bool = False
    """True: weights pushed while a batch generates are swapped in between two decoding steps, so the responses in
    flight (the episodes of `rollout.multi_turn.enable` too, across their turns) go on with the new weights (their
    earlier tokens' keys and values stay those of the old ones; under LoRA the pushed adapters are merged again into
    the decoding copy); each sampled token keeps its behaviour log-prob and is labelled (`rollout_versions`, what
    `async/staleness_*` count) with the oldest weight version among the keys and values it attended to: the version
    that prefilled its prompt (in the turn-by-turn episode loop, its turn's prefill), not the newer one that sampled
    it; appended tool or environment tokens neither (masked). False: a batch is generated with the weights it
    started with (`rollout.name=hf` swaps between chunks of rows only). Not with `rollout.agent.program`"""
    trigger_parameter_sync_step: int = 1
    """with `rollout.n_gpus_per_node` > 0: training steps (updates on one batch each) between two weight pushes to
    the generating process"""
    require_batches: int = 1
    """with `rollout.n_gpus_per_node` > 0: mini-batches (`actor_rollout_ref.actor.ppo_mini_batch_size` prompts each)
    one training step takes; `data.train_batch_size=0` (verl's fully asynchronous scripts) sets the batch to
    require_batches x ppo_mini_batch_size, and a positive one must equal it unless require_batches=1"""
    wait_timeout_s: float = 1800.0
    """the longest any process waits for the other group (a batch, a weight push) before the run stops with an
    error; a process that dies stops the run at once"""
