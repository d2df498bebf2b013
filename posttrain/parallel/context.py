"""This process's place in a job — ranks, the device mesh (data parallel x tensor parallel) — and the few
collectives the training loop needs.

A one-process run without sharding has no process group: every collective here is then the identity, so the loop
and the roles run the same code at any world size. Data-parallel collectives run over the data-parallel ranks only:
the ranks of one tensor-parallel group hold the same rows, so counting them again would double every sum.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
from dataclasses import dataclass
from typing import NoReturn

import torch
import torch.distributed as dist

from ..errors import ConfigError
from ..host_memory import keep_freed_memory

_joined_process_group = False  # this process has run collectives: see exit_process
_peers = None  # the process group of this process's peers: None = the whole job (asynchronous RL: its own group)


def set_peers(group) -> None:
    """Make `group` this process's peers: the job-wide collectives below (barrier, a decision every rank takes,
    checkpoint writes, sharded model loading) then run over it alone. Asynchronous RL's groups set it: the
    training processes are each other's peers, a generating process is its own."""
    global _peers
    _peers = group


def peer_group():
    """The process group of this process's peers (None: the whole job)."""
    return _peers


def peer_count() -> int:
    return dist.get_world_size(_peers) if dist.is_available() and dist.is_initialized() else 1


@dataclass(frozen=True)
class ParallelDims:
    """world = dp_replicate x dp_shard x replicas x sp x tp. FSDP shards over dp_shard (x replicas x sp) and
    replicates over dp_replicate (HSDP); tensor parallel splits each layer over tp; Ulysses sequence parallel splits
    each sequence over sp (models/ulysses.py); `replicas` ranks compute the same rows whole (a Megatron layout's
    pipeline ranks: they shard the model between them, and their gradients, each the whole gradient, are averaged);
    the data-parallel degree dp = dp_replicate x dp_shard. The ranks of one replicas, sp or tp group hold the same
    rows."""

    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    sp: int = 1
    replicas: int = 1

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def world(self) -> int:
        return self.dp * self.replicas * self.sp * self.tp

    @classmethod
    def of(cls, world: int, *, fsdp_size: int = -1, tp: int = 1, sp: int = 1, replicas: int = 1) -> "ParallelDims":
        """Split `world` processes: tp per tensor-parallel group, sp per sequence-parallel group, `replicas` per
        group computing the same rows, then FSDP groups of `fsdp_size` (-1 = all)."""
        if tp < 1 or world % tp:
            raise ConfigError(f"actor_rollout_ref.actor.fsdp_config.tp_size={tp} must divide the {world} processes")
        check_sequence_parallel(world, sp=sp, tp=tp, fsdp_size=fsdp_size)
        check_replicas(world, replicas=replicas, tp=tp, sp=sp, fsdp_size=fsdp_size)
        dp = world // (tp * sp * replicas)
        shard = dp if fsdp_size in (-1, 0) else fsdp_size
        if shard < 1 or dp % shard:
            raise ConfigError(f"fsdp_config.fsdp_size={fsdp_size} must divide the {dp} data-parallel processes "
                              f"({world} processes / tp_size {tp})")
        return cls(dp // shard, shard, tp, sp, replicas)


def check_sequence_parallel(world: int, *, sp: int, tp: int, fsdp_size: int) -> None:
    """Refuse the layouts sequence parallel does not run: with tensor parallel (both split the attention heads over
    ranks; one split of them is supported), with HSDP (FSDP shards over every data x sequence rank), or an sp that
    does not divide the processes."""
    key = "actor_rollout_ref.actor.ulysses_sequence_parallel_size"
    if sp < 1 or world % sp:
        raise ConfigError(f"{key}={sp} must divide the {world} processes")
    if sp > 1 and tp > 1:
        raise ConfigError(f"{key}={sp} with fsdp_config.tp_size={tp}: not supported (both split the attention heads "
                          "over ranks); use one of them")
    if sp > 1 and fsdp_size not in (-1, 0):
        raise ConfigError(f"{key}={sp} with fsdp_config.fsdp_size={fsdp_size}: not supported (FSDP shards over "
                          "every data x sequence-parallel rank); remove fsdp_size")


def check_replicas(world: int, *, replicas: int, tp: int, sp: int, fsdp_size: int) -> None:
    """Refuse the layouts row replicas do not run: a size that does not divide what tensor and sequence parallel
    leave, or with HSDP (FSDP shards over every data x replica rank)."""
    key = "actor_rollout_ref.actor.row_replicas"
    if replicas < 1 or world % (tp * sp * replicas):
        raise ConfigError(f"{key}={replicas} must divide the {world // max(tp * sp, 1)} processes tensor and "
                          f"sequence parallel leave ({world} processes / tp_size {tp} / ulysses {sp})")
    if replicas > 1 and fsdp_size not in (-1, 0):
        raise ConfigError(f"{key}={replicas} with fsdp_config.fsdp_size={fsdp_size}: not supported (FSDP shards over "
                          "every data x replica rank); remove fsdp_size")


class Parallel:
    """Ranks, devices and meshes of this process; `distributed` is False for a plain one-process run. Job-wide
    collectives (`barrier`, `max(all_ranks=True)`) run over the peers (`set_peers`)."""

    def __init__(self, dims: ParallelDims = ParallelDims(), *, device: torch.device = torch.device("cpu"),
                 mesh=None, rank: int | None = None):
        """`rank`: this process's rank in a job whose other processes are not its peers (asynchronous RL's
        groups: the process runs alone, only rank 0 writes the run folder)."""
        self.dims, self.device, self.mesh = dims, torch.device(device), mesh
        self.distributed = mesh is not None
        self.rank = dist.get_rank() if self.distributed else rank or 0
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        self.sp_group = self.replica_group = None
        if self.distributed:
            names = ("dp_replicate", "dp_shard")
            self.dp_mesh = mesh[names]._flatten("dp") if dims.dp_replicate > 1 else mesh["dp_shard"]
            self.fsdp_mesh = mesh[names] if dims.dp_replicate > 1 else mesh["dp_shard"]
            if dims.sp > 1 or dims.replicas > 1:  # FSDP shards over the ranks holding the same rows too
                along = tuple(n for n, size in (("dp_shard", 0), ("replicas", dims.replicas), ("sp", dims.sp))
                              if n == "dp_shard" or size > 1)
                self.fsdp_mesh = mesh[along]._flatten("_".join(along)) if len(along) > 1 else mesh[along[0]]
            if dims.sp > 1:  # FSDP's gradient sum over the sequence shards adds each rank's tokens' gradients
                self.sp_group = mesh["sp"].get_group()
            if dims.replicas > 1:  # each computes the whole gradient of the same rows: parallelize averages them
                self.replica_group = mesh["replicas"].get_group()
            self.tp_mesh = mesh["tp"]
            self.dp_rank = self.dp_mesh.get_local_rank()
            self._dp_group = self.dp_mesh.get_group()
        else:
            self.dp_mesh = self.fsdp_mesh = self.tp_mesh = self._dp_group = None
            self.dp_rank = 0

    @property
    def world(self) -> int:
        return self.dims.world

    @property
    def dp(self) -> int:
        return self.dims.dp

    @property
    def is_main(self) -> bool:
        """Rank 0 alone writes the run folder and logs."""
        return self.rank == 0

    @property
    def _dp_collectives(self) -> bool:
        return self.distributed and self.dims.dp > 1

    # ------------------------------------------------------------------ collectives over data-parallel ranks

    def sum(self, values: torch.Tensor) -> torch.Tensor:
        """Element-wise sum over the data-parallel ranks (a copy, float64 on CPU for exact small sums)."""
        out = values.detach().to(torch.float64).cpu().clone()
        if self._dp_collectives:
            out = out.to(self._comm_device)
            dist.all_reduce(out, group=self._dp_group)
            out = out.cpu()
        return out

    def max(self, value: int, *, all_ranks: bool = False) -> int:
        """The largest `value` over the data-parallel ranks, or over every rank of the job with `all_ranks` (a
        decision that every rank must take alike, such as stopping after this step)."""
        if not (self.distributed and self.world > 1 if all_ranks else self._dp_collectives):
            return int(value)
        t = torch.tensor([int(value)], dtype=torch.int64, device=self._comm_device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=_peers if all_ranks else self._dp_group)
        return int(t.item())

    def gather(self, obj) -> list:
        """`obj` of every data-parallel rank, in rank order. Ranks that compute the same rows (`replicas`) all take
        the first one's: what they generate or compute is then the same on each, bit for bit, whatever a device's
        kernels did."""
        out = [obj]
        if self._dp_collectives:
            out = [None] * self.dims.dp
            dist.all_gather_object(out, obj, group=self._dp_group)
        if self.replica_group is not None:
            held = [out]
            dist.broadcast_object_list(held, group=self.replica_group,
                                       group_src=0)  # the group's first rank
            out = held[0]
        return out

    def barrier(self) -> None:
        if self.distributed and self.world > 1:
            dist.barrier(group=_peers)

    @property
    def _comm_device(self) -> torch.device:
        return self.device if dist.get_backend() == "nccl" else torch.device("cpu")

    # ------------------------------------------------------------------ splitting work

    def my_slice(self, n: int) -> slice:
        """Contiguous share of `n` items for this data-parallel rank (the first ranks take one more if uneven)."""
        base, extra = divmod(n, self.dims.dp)
        start = self.dp_rank * base + min(self.dp_rank, extra)
        return slice(start, start + base + (1 if self.dp_rank < extra else 0))

    def my_samples(self, prompts: int, n: int) -> list[tuple[int, int, int]]:
        """This rank's share of a step's `prompts` x `n` responses, as runs (prompt, first sample, samples): whole
        prompts when they divide evenly over the data-parallel ranks, otherwise a contiguous share of the (prompt,
        sample) pairs in prompt order, so a prompt's samples may straddle ranks (8 prompts x 16 over 64 ranks: 2
        samples of one prompt each; the config check makes the pairs divide evenly). Gathered in rank order, the
        rows are in prompt order either way."""
        if prompts % self.dims.dp == 0:
            share = self.my_slice(prompts)
            return [(p, 0, n) for p in range(share.start, share.stop)]
        runs: list[tuple[int, int, int]] = []
        share = self.my_slice(prompts * n)
        for pair in range(share.start, share.stop):
            prompt, sample = divmod(pair, n)
            if runs and runs[-1][0] == prompt:
                runs[-1] = (prompt, runs[-1][1], runs[-1][2] + 1)
            else:
                runs.append((prompt, sample, 1))
        return runs


def env_world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def joined_world() -> int:
    """The number of processes of the process group this process joined (1 where it joined none)."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def gather_in(group, obj) -> tuple[list, int]:
    """`obj` of every rank of `group` (a process group another library built, such as vLLM's tensor-parallel
    group), in rank order, and this rank's place among them."""
    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out, dist.get_rank(group)


def node_leaders_first(work, failed):
    """`work()` on local rank 0 of every node first, then on the node's other ranks, which find what it left in
    node-local storage (a download cache) instead of doing it again at once. A failure of any node's first rank
    stops every rank: that rank raises its own error, the others `failed(message)`, and no other rank runs `work`.
    Every rank of the job must call this; outside a multi-process job it is just `work()`."""
    if peer_count() == 1:
        return work()
    leader = int(os.environ.get("LOCAL_RANK", "0")) == 0
    result, failure, said = None, None, None
    if leader:
        try:
            result = work()
        except Exception as error:  # noqa: BLE001 - the other ranks must hear of it, or they wait forever
            failure, said = error, f"rank {dist.get_rank()}: {error}"
    heard = [None] * peer_count()
    dist.all_gather_object(heard, said, group=_peers)
    if failure is not None:
        raise failure
    first = next((h for h in heard if h is not None), None)
    if first is not None:
        raise failed(first)
    return result if leader else work()


def local_device(use_cuda: bool) -> torch.device:
    """This process's device: GPU LOCAL_RANK, or the CPU."""
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if use_cuda else torch.device("cpu")


def join_process_group(backend: str, *, timeout, device: torch.device) -> None:
    """Join the launcher's job with `backend`, every collective limited to `timeout` (a timedelta)."""
    global _joined_process_group
    _joined_process_group = True
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, timeout=timeout)


def init_parallel(*, device_name: str = "auto", fsdp_size: int = -1, tp: int = 1, sp: int = 1, replicas: int = 1,
                  need_sharding: bool = False) -> Parallel:
    """Join the job torchrun started (WORLD_SIZE > 1), or stay a plain single process.

    `need_sharding` asks for FSDP2 even in one process (CPU offload of a role needs it); that process then gets a
    process group of its own. CUDA ranks use NCCL on device LOCAL_RANK; CPU ranks use gloo.
    """
    world = env_world_size()
    use_cuda = device_name == "cuda" or (device_name == "auto" and torch.cuda.is_available())
    if device_name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("trainer.device=cuda but no CUDA device is available (torch.cuda.is_available() is "
                          "False); use trainer.device=auto or cpu")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    if not use_cuda:  # each step's activations reuse the last step's pages (host_memory.py)
        keep_freed_memory()
    if world == 1 and not need_sharding and tp == 1 and sp == 1:
        return Parallel(device=torch.device("cuda") if use_cuda else device)
    dims = ParallelDims.of(world, fsdp_size=fsdp_size, tp=tp, sp=sp, replicas=replicas)
    if not dist.is_initialized():
        global _joined_process_group
        _joined_process_group = True
        backend = "nccl" if use_cuda else "gloo"
        if use_cuda:
            torch.cuda.set_device(device)
        if world == 1 and "MASTER_ADDR" not in os.environ:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
        else:
            dist.init_process_group(backend)
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device.type, (dims.dp_replicate, dims.dp_shard, dims.replicas, dims.sp, dims.tp),
                            mesh_dim_names=("dp_replicate", "dp_shard", "replicas", "sp", "tp"))
    return Parallel(dims, device=device, mesh=mesh)


def shutdown() -> None:
    """Leave the job together: a rank that tears down its connections while another still uses them aborts it."""
    if dist.is_initialized():
        if dist.get_world_size() > 1:
            dist.barrier()
        dist.destroy_process_group()


def exit_process(code: int | None) -> NoReturn:
    """End the process with `code`; one that joined a process group skips the interpreter's teardown.

    gloo's worker threads free each finished collective's tensors, and a barrier holds on to the collectives before
    it, so a worker may still be freeing them after the main thread has returned. Freeing a tensor that a Python
    object owns takes the GIL, which a finalizing interpreter answers by ending the thread, and that aborts the
    process in C++ ("terminate called without an active exception", SIGABRT) after a run that succeeded. So such a
    process waits for its other threads, runs its exit handlers, flushes its output and exits at once."""
    if not _joined_process_group:
        sys.exit(code)
    # the first two steps of the interpreter's own teardown, in its order: wait for the other threads (after
    # running what they registered to be stopped, e.g. thread pools), then the exit handlers
    threading._shutdown()  # noqa: SLF001
    atexit._run_exitfuncs()  # noqa: SLF001
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed or gone: nothing left to write
            pass
    os._exit(code or 0)
