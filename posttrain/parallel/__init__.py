"""Processes and what passes between them: joining the job and its device mesh, the collectives the other packages
call (`Parallel.sum` / `max` / `gather`, `agreed`, `node_leaders_first`), sharding a model (shard), launching local
workers (launch), sharded checkpoints (checkpoint, safeload), splitting rows over ranks (balance), and asynchronous
RL's two groups of processes (groups, weight_sync), a sequence split over ranks (ulysses). The only package
that imports torch.distributed (tests/test_layers.py holds every other package to that)."""

from . import balance
from .context import Parallel, ParallelDims, init_parallel, shutdown
from .shard import (ShardSettings, agreed, clip_grad_norm, gathered_for_generation, is_sharded, parallelize,
                    prepare_model, set_gradient_sync, tensor_parallel)

__all__ = ["balance", "Parallel", "ParallelDims", "init_parallel", "shutdown", "ShardSettings", "agreed",
           "clip_grad_norm", "gathered_for_generation", "is_sharded", "parallelize", "prepare_model",
           "set_gradient_sync", "tensor_parallel"]
