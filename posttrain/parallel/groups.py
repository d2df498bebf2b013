"""Two groups of processes for asynchronous RL: rank 0 trains, the other ranks generate.

Both groups share one process group (`join`); finished batches travel from a generating rank to the trainer as
pickled objects over a gloo group (`send_object` / `recv_object`), weights the other way (weight_sync.py). Every
wait is bounded by the groups' timeout: a rank that stops answering ends the run with an error, and a rank that
dies breaks the connection at once, so its own error is what the launcher reports.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from . import context
from .context import Parallel

TRAINER = 0  # the rank that trains; every other rank generates


@dataclass
class Groups:
    """This process's place in a two-group job."""

    rank: int
    world: int
    par: Parallel  # this process alone: training and generation each run in one process
    objects: object  # the gloo group batches travel over (weights go over the job's own group: NCCL on GPUs)

    @property
    def trains(self) -> bool:
        return self.rank == TRAINER


def join(*, device_name: str, timeout_s: float) -> Groups:
    """Join the job the launcher started, every wait limited to `timeout_s`."""
    use_cuda = device_name == "cuda" or (device_name == "auto" and torch.cuda.is_available())
    device = context.local_device(use_cuda)
    timeout = timedelta(seconds=timeout_s)
    context.join_process_group("nccl" if use_cuda else "gloo", timeout=timeout, device=device)
    objects = dist.new_group(backend="gloo", timeout=timeout)
    rank = dist.get_rank()
    return Groups(rank=rank, world=dist.get_world_size(), par=Parallel(device=device, rank=rank), objects=objects)


def send_object(obj, dst: int, group) -> None:
    """`obj` pickled to rank `dst` (which calls `recv_object`): its size, then its bytes."""
    data = torch.frombuffer(bytearray(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)), dtype=torch.uint8)
    dist.send(torch.tensor([data.numel()], dtype=torch.int64), dst=dst, group=group)
    dist.send(data, dst=dst, group=group)


def recv_object(src: int, group):
    size = torch.empty(1, dtype=torch.int64)
    dist.recv(size, src=src, group=group)
    data = torch.empty(int(size.item()), dtype=torch.uint8)
    dist.recv(data, src=src, group=group)
    return pickle.loads(data.numpy().tobytes())  # noqa: S301 - our own processes' objects
