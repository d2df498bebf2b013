"""Two groups of processes for asynchronous RL: ranks 0..N-1 train, the last rank generates.

The training ranks are each other's peers (context.set_peers): their device mesh (FSDP2 over the N ranks), their
barriers, stop decisions and checkpoint writes run over their own process group, never waiting for the generating
rank. Finished batches travel from the generating rank to every training rank as pickled objects over a gloo
group (`send_object` / `recv_object`): each holds the step's whole batch, as in synchronous RL, and its model passes
compute on its share. Weights go the other way from training rank 0 to the generating rank over a group of those
two (weight_sync.py). Every wait is bounded by the groups' timeout: a rank that stops answering ends the run with an
error, and a rank that dies breaks the connection at once, so its own error is what the launcher reports.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from . import context
from .context import Parallel, ParallelDims

TRAINER = 0  # the training rank that tells the generator where to start and pushes the weights


@dataclass
class Groups:
    """This process's place in a two-group job."""

    rank: int
    world: int
    trainers: int  # ranks 0..trainers-1 train; the rank after them generates
    par: Parallel  # the training ranks' mesh, or the generating process alone
    objects: object  # the gloo group batches travel over
    push: object  # training rank 0 and the generating rank: weights (NCCL on GPUs)

    @property
    def trains(self) -> bool:
        return self.rank < self.trainers

    @property
    def generator(self) -> int:
        return self.trainers


def join(*, device_name: str, timeout_s: float, trainers: int = 1, fsdp_size: int = -1) -> Groups:
    """Join the job the launcher started (`trainers` training ranks, then one generating rank), every wait
    limited to `timeout_s`. Every rank creates every group, in the same order (torch requires it)."""
    use_cuda = device_name == "cuda" or (device_name == "auto" and torch.cuda.is_available())
    device = context.local_device(use_cuda)
    timeout = timedelta(seconds=timeout_s)
    context.join_process_group("nccl" if use_cuda else "gloo", timeout=timeout, device=device)
    rank, world = dist.get_rank(), dist.get_world_size()
    if world != trainers + 1:
        raise RuntimeError(f"asynchronous RL needs {trainers} training processes and 1 generating process, but the "
                           f"job has {world}")
    objects = dist.new_group(backend="gloo", timeout=timeout)
    training = dist.new_group(list(range(trainers)), timeout=timeout)
    generating = dist.new_group([trainers], timeout=timeout)
    push = dist.new_group([TRAINER, trainers], timeout=timeout) if trainers > 1 else None
    mesh, dims = None, ParallelDims()
    if trainers > 1:  # a mesh over the training ranks; every rank of the job takes part in creating it
        from torch.distributed.device_mesh import DeviceMesh

        dims = ParallelDims.of(trainers, fsdp_size=fsdp_size)
        mesh = DeviceMesh(device.type, torch.arange(trainers).reshape(dims.dp_replicate, dims.dp_shard, 1, 1, 1),
                          mesh_dim_names=("dp_replicate", "dp_shard", "replicas", "sp", "tp"))
    trains = rank < trainers
    context.set_peers(training if trains else generating)
    par = Parallel(dims, device=device, mesh=mesh) if trains and mesh is not None else Parallel(device=device,
                                                                                                 rank=rank)
    return Groups(rank=rank, world=world, trainers=trainers, par=par, objects=objects, push=push)


def send_object(obj, dst: int | list[int], group) -> None:
    """`obj` pickled to rank `dst` (or each rank of a list; each calls `recv_object`): its size, then its bytes."""
    data = torch.frombuffer(bytearray(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)), dtype=torch.uint8)
    size = torch.tensor([data.numel()], dtype=torch.int64)
    for rank in [dst] if isinstance(dst, int) else dst:
        dist.send(size, dst=rank, group=group)
        dist.send(data, dst=rank, group=group)


def recv_object(src: int, group):
    size = torch.empty(1, dtype=torch.int64)
    dist.recv(size, src=src, group=group)
    data = torch.empty(int(size.item()), dtype=torch.uint8)
    dist.recv(data, src=src, group=group)
    return pickle.loads(data.numpy().tobytes())  # noqa: S301 - our own processes' objects
