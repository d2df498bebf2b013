"""Pushing the trainer's weights to the generating processes after an update (two groups of processes), and
gathering a sharded model's weights whole, unit by unit, for an engine that holds its own copy (vLLM: `fsdp_units`,
`units_gathered`, `whole`).

What travels is what training changes: the trainable parameters (under LoRA the adapter tensors only; a frozen
vision tower not at all). They are packed as raw bytes into buckets of at most `bucket_bytes` and each bucket is one
broadcast over the process group (gloo on CPU, NCCL on GPUs), so a push is a few large messages, not one per tensor,
and the receiver's copy is equal to the sender's bit for bit, whatever the dtypes. A header broadcast first carries
the weight version (0 = the loaded weights, +1 per optimizer step) and a fingerprint of the tensor layout: a receiver
whose model differs fails with a clear error instead of copying bytes into the wrong tensors. A negative version is
the sender's "stop" (no weights follow).
"""

from __future__ import annotations

import contextlib
import time
import zlib

import torch
import torch.distributed as dist
from torch import nn

STOP = -1  # the header's version when the sender ends the exchange instead of pushing


def trainable_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """The parameters an update changes, by name: every one with requires_grad (LoRA: the adapters alone)."""
    out = {name: p for name, p in model.named_parameters() if p.requires_grad}
    sharded = [name for name, p in out.items() if type(p.data) is not torch.Tensor and hasattr(p.data, "full_tensor")]
    if sharded:
        raise ValueError(f"weight sync needs whole (unsharded) tensors; {sharded[0]} is sharded")
    return out


class WholeTrainable:
    """The trainable parameters of the training processes' model, whole, for the sender's WeightSync. A model held
    whole is used as it is. An FSDP2-sharded one is gathered by `gather()`, which every training rank calls (an
    all-gather per tensor over its mesh) and whose result only `keep` (the pushing rank) holds, in buffers of its
    own: the trainable tensors whole once more in that rank's memory."""

    def __init__(self, model: nn.Module, *, keep: bool, device: torch.device):
        self.params = {name: p for name, p in model.named_parameters() if p.requires_grad}
        self.sharded = any(hasattr(p.data, "full_tensor") for p in self.params.values())
        if not self.sharded:
            self.tensors = trainable_tensors(model)
        else:
            self.tensors = {n: torch.empty(p.shape, dtype=p.dtype, device=device) for n, p in self.params.items()
                            } if keep else {}

    @torch.no_grad()
    def gather(self) -> None:
        if not self.sharded:
            return
        for name, p in self.params.items():
            whole = p.full_tensor()
            if self.tensors:
                self.tensors[name].copy_(whole)


def _fingerprint(tensors: dict[str, torch.Tensor]) -> int:
    layout = ";".join(f"{n}:{tuple(t.shape)}:{t.dtype}" for n, t in tensors.items())
    return zlib.crc32(layout.encode())


def _buckets(tensors: list[torch.Tensor], bucket_bytes: int) -> list[list[torch.Tensor]]:
    """Consecutive tensors grouped so that each group's bytes stay within `bucket_bytes` (a larger tensor alone)."""
    out, current, size = [], [], 0
    for t in tensors:
        n = t.numel() * t.element_size()
        if current and size + n > bucket_bytes:
            out.append(current)
            current, size = [], 0
        current.append(t)
        size += n
    if current:
        out.append(current)
    return out


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).view(torch.uint8)


class WeightSync:
    """One side of the exchange: `src` pushes (`push`), every other rank of `group` receives (`receive`) into its own
    tensors of the same names, shapes and dtypes. `version` is the last version pushed or received; `seconds` and
    `bytes` the cost of the last exchange."""

    def __init__(self, tensors: dict[str, torch.Tensor], *, src: int, group=None, bucket_bytes: int = 512 << 20):
        if bucket_bytes < 1:
            raise ValueError(f"bucket_bytes={bucket_bytes} must be >= 1")
        self.names = sorted(tensors)
        self.tensors = [tensors[n] for n in self.names]
        for name, t in zip(self.names, self.tensors):
            if not t.is_contiguous():
                raise ValueError(f"weight sync needs contiguous tensors; {name} is not")
        self.src, self.group, self.bucket_bytes = src, group, bucket_bytes
        self.fingerprint = _fingerprint(dict(zip(self.names, self.tensors)))
        self.version, self.seconds, self.bytes = 0, 0.0, 0
        device = self.tensors[0].device if self.tensors else torch.device("cpu")
        nccl = dist.get_backend(group) == "nccl"
        self._device = device if nccl else torch.device("cpu")

    @property
    def total_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors)

    def _header(self, version: int) -> torch.Tensor:
        return torch.tensor([version, len(self.tensors), self.total_bytes, self.fingerprint], dtype=torch.int64,
                            device=self._device)

    @torch.no_grad()
    def push(self, version: int) -> None:
        """Broadcast `version` and the tensors (the sender's side); `version` < 0 (STOP) sends the header alone."""
        start = time.perf_counter()
        dist.broadcast(self._header(version), src=self.src, group=self.group)
        if version >= 0:
            for bucket in _buckets(self.tensors, self.bucket_bytes):
                buffer = torch.cat([_as_bytes(t).to(self._device) for t in bucket])
                dist.broadcast(buffer, src=self.src, group=self.group)
            self.version = version
        self.seconds, self.bytes = time.perf_counter() - start, self.total_bytes if version >= 0 else 0

    @torch.no_grad()
    def receive(self) -> int:
        """Wait for the sender's next push and copy it into this side's tensors; returns the version (STOP: none)."""
        start = time.perf_counter()
        header = self._header(0)
        dist.broadcast(header, src=self.src, group=self.group)
        version, count, size, fingerprint = (int(x) for x in header.tolist())
        if version < 0:
            return STOP
        if (count, size, fingerprint) != (len(self.tensors), self.total_bytes, self.fingerprint):
            raise RuntimeError(f"weight sync: the sender's tensors ({count} tensors, {size} bytes) differ from this "
                               f"process's ({len(self.tensors)} tensors, {self.total_bytes} bytes, or other names, "
                               "shapes or dtypes); both sides must build the same model with the same LoRA settings")
        for bucket in _buckets(self.tensors, self.bucket_bytes):
            buffer = torch.empty(sum(t.numel() * t.element_size() for t in bucket), dtype=torch.uint8,
                                 device=self._device)
            dist.broadcast(buffer, src=self.src, group=self.group)
            offset = 0
            for t in bucket:
                n = t.numel() * t.element_size()
                _as_bytes(t).copy_(buffer[offset:offset + n])
                offset += n
        self.version, self.seconds, self.bytes = version, time.perf_counter() - start, self.total_bytes
        return version


def fsdp_units(model: nn.Module) -> dict[nn.Module, nn.Module | None]:
    """Each module of `model` and the FSDP2 unit that holds its parameters: the nearest sharded module at or above it
    (None where nothing is sharded)."""
    from torch.distributed.fsdp import FSDPModule

    by_name: dict[str, nn.Module | None] = {}
    units: dict[nn.Module, nn.Module | None] = {}
    for name, module in model.named_modules():  # parents come first
        parent = by_name[name.rsplit(".", 1)[0] if "." in name else ""] if name else None
        by_name[name] = units[module] = module if isinstance(module, FSDPModule) else parent
    return units


@contextlib.contextmanager
def units_gathered(units: list[nn.Module]):
    """FSDP units gathered (every rank of their mesh together) for a block, and freed after."""
    for unit in units:
        unit.unshard()
    try:
        yield
    finally:
        for unit in units:
            unit.reshard()


def whole(t: torch.Tensor) -> torch.Tensor:
    """`t` whole: a tensor-parallel piece (a DTensor) joined over its mesh (a collective), a plain tensor as it is."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t
