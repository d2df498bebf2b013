"""Sharded model and optimizer state with Distributed Checkpoint: each rank writes its own shards, and a load
reshards to whatever layout the loading job has — another world size, tensor parallel or not, or one plain process."""

from __future__ import annotations

import warnings
from pathlib import Path

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_state_dict, set_model_state_dict,
                                                     set_state_dict)

from .context import peer_group
from .safeload import SafeReader, check_dcp_files
from torch.distributed.tensor import DTensor


def _held_whole(model) -> bool:
    """No parameter is split over processes (no FSDP shard, no tensor-parallel slice)."""
    return not any(isinstance(p, DTensor) for p in model.parameters())


def role_state(model, optimizer=None) -> dict:
    """{"model": ..., "optimizer": ...} keyed by parameter names, whatever the sharding."""
    if optimizer is None:
        return {"model": get_model_state_dict(model)}
    model_sd, optim_sd = get_state_dict(model, optimizer)
    return {"model": model_sd, "optimizer": optim_sd}


def save_role(path: Path, model, optimizer=None) -> None:
    """Every rank that holds a shard of `model` calls this (the peers: in asynchronous RL the training processes);
    a model held whole is written by its process alone."""
    with warnings.catch_warnings():  # one process, no process group: DCP says it assumes so; that is the intent
        warnings.filterwarnings("ignore", message=".*assuming the intent is to save in a single process.*")
        dcp.save(role_state(model, optimizer), checkpoint_id=str(path), no_dist=_held_whole(model),
                 process_group=peer_group())


def load_role(path: Path, model, optimizer=None, *, alone: bool = False) -> None:
    """Read `path` into the model (and optimizer) in place; the checkpoint may come from any layout. The files are
    checked first (a missing or truncated shard is named) and the metadata is read without running code. `alone`:
    this process reads the whole of it without the job's other ranks (an export), so no collective runs; nor does
    one runs for a model held whole."""
    check_dcp_files(path)
    state = role_state(model, optimizer)
    with warnings.catch_warnings():  # one process, no process group: DCP says it assumes so; that is the intent
        warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process.*")
        dcp.load(state, storage_reader=SafeReader(str(path)), no_dist=alone or _held_whole(model),
                 process_group=None if alone else peer_group())
    if optimizer is None:
        set_model_state_dict(model, state["model"])
    else:
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])

