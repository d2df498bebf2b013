"""Reading checkpoint files without running code from them.

A pickle can call any function while it loads, so a checkpoint someone else could write (a shared folder, a
downloaded run) must not be unpickled freely. `.pt` files load with `torch.load(weights_only=True)`; Distributed
Checkpoint's `.metadata` file is a plain pickle that torch reads with `pickle.load`, so it is read here with an
unpickler that admits only the checkpoint's own record types, dtypes, sizes and paths.
"""

from __future__ import annotations

import dataclasses
import enum
import io
import pickle
from pathlib import Path

import torch
from torch.distributed.checkpoint import FileSystemReader


class UnsafeCheckpoint(RuntimeError):
    """A checkpoint file holds something other than tensors and plain data: it is refused, nothing in it ran."""


_DCP_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem",
                "torch.distributed.checkpoint.planner")
_PATHS = ("PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath")


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, file, source: Path):
        super().__init__(file)
        self.source = source

    def find_class(self, module: str, name: str):
        if module in _DCP_MODULES:
            obj = super().find_class(module, name)
            if isinstance(obj, type) and (dataclasses.is_dataclass(obj) or issubclass(obj, enum.Enum)):
                return obj
        elif module == "torch" and (name == "Size" or isinstance(getattr(torch, name, None), torch.dtype)):
            return getattr(torch, name)
        elif (module, name) == ("torch.serialization", "_get_layout"):
            return super().find_class(module, name)
        elif module == "pathlib" and name in _PATHS:
            return super().find_class(module, name)
        elif (module, name) == ("collections", "OrderedDict"):
            return super().find_class(module, name)
        raise UnsafeCheckpoint(f"{self.source} refers to {module}.{name}, which a checkpoint's metadata never "
                               "holds; refusing to load it (a planted file can run code when unpickled)")


def read_dcp_metadata(path: Path):
    """The Metadata of a Distributed Checkpoint folder, read with the restricted unpickler."""
    source = Path(path) / ".metadata"
    if not source.is_file():
        raise OSError(f"{source} is missing")
    data = source.read_bytes()
    try:
        return _MetadataUnpickler(io.BytesIO(data), source).load()
    except UnsafeCheckpoint:
        raise
    except Exception as e:  # truncated or not a pickle at all
        raise OSError(f"{source} is damaged ({type(e).__name__}: {e})") from None


class SafeReader(FileSystemReader):
    """FileSystemReader whose metadata read cannot run code (the tensor data itself is read by torch with
    weights_only=True already)."""

    def read_metadata(self, *args, **kwargs):
        rank = kwargs.get("rank")
        metadata = read_dcp_metadata(Path(self._get_metadata_path(rank)).parent)
        if getattr(metadata, "storage_meta", None) is None:
            from torch.distributed.checkpoint.metadata import StorageMeta

            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def check_dcp_files(path: Path) -> None:
    """Every shard file the metadata names exists and is long enough: a truncated or missing shard is reported by
    file name before anything is loaded (DCP's own error names neither)."""
    metadata = read_dcp_metadata(path)
    need: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        need[info.relative_path] = max(need.get(info.relative_path, 0), info.offset + info.length)
    for name, size in sorted(need.items()):
        f = Path(path) / name
        if not f.is_file():
            raise OSError(f"{f} is missing")
        if f.stat().st_size < size:
            raise OSError(f"{f} is truncated ({f.stat().st_size} bytes, the metadata expects at least {size})")


def load_plain(path: Path):
    """torch.load with weights_only=True, naming the file when it holds anything else."""
    try:
        return torch.load(path, weights_only=True)
    except pickle.UnpicklingError as e:
        raise UnsafeCheckpoint(f"{path} holds objects other than tensors and plain data, so it is refused "
                               f"(loading it could run code). torch says: {str(e).splitlines()[0]}") from None
    except (RuntimeError, EOFError) as e:
        raise OSError(f"{path} is damaged ({type(e).__name__}: {str(e).splitlines()[0]})") from None
