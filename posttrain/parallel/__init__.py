"""Processes, meshes and sharding: everything that imports torch.distributed lives here (DESIGN.md)."""

from . import balance
from .context import Parallel, ParallelDims, init_parallel, shutdown
from .shard import (ShardSettings, agreed, clip_grad_norm, gathered_for_generation, is_sharded, parallelize,
                    prepare_model, set_gradient_sync)

__all__ = ["balance", "Parallel", "ParallelDims", "init_parallel", "shutdown", "ShardSettings", "agreed",
           "clip_grad_norm", "gathered_for_generation", "is_sharded", "parallelize", "prepare_model",
           "set_gradient_sync"]
