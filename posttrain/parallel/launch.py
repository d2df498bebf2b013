"""Starting several processes: `posttrain train` launches its own local workers with torch's elastic launcher when
the config asks for more than one device, and runs unchanged inside an outer `torchrun` (multi-node, Slurm, k8s)."""

from __future__ import annotations

import os
import signal
import sys
import uuid

from ..errors import ConfigError

SHUTDOWN_TIMEOUT_S = 3600  # how long a signalled launcher waits for its workers' last step and checkpoint


def inside_launcher() -> bool:
    """Started by torchrun (or by `launch` below): the process knows its rank."""
    return "LOCAL_RANK" in os.environ and "WORLD_SIZE" in os.environ


def die_with_launcher() -> None:
    """A worker ends when its launcher does: torch's launcher starts each worker in a session of its own, so a
    launcher killed with SIGKILL (a lost node, `kill -9`, an out-of-memory kill) would leave the workers training on,
    writing into the run folder alongside the restarted job. Linux only (prctl PR_SET_PDEATHSIG)."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes
    import signal

    parent = os.getppid()
    ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:  # the launcher died before the call above
        os._exit(1)


def recorded(main):
    """`main` wrapped so that, under a launcher, a failing rank's error is written where the launcher reports it
    from (torch's elastic error file, which `root_cause` reads)."""
    from torch.distributed.elastic.multiprocessing.errors import record

    return record(main)


def requested_world(cfg) -> int:
    """Processes of the job: the training ones, and with asynchronous RL the generating ones beside them."""
    return cfg.trainer.nnodes * cfg.trainer.n_gpus_per_node + cfg.rollout.nnodes * cfg.rollout.n_gpus_per_node


def per_node(cfg) -> int:
    return cfg.trainer.n_gpus_per_node + cfg.rollout.n_gpus_per_node


def adopt_launcher_world(cfg) -> list[str]:
    """Inside torchrun: the config must describe the job torchrun started. Left at their defaults (1 x 1), the keys
    take torchrun's layout; otherwise a mismatch is an error. Returns notes for the user."""
    world, local = int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"]))
    tr = cfg.trainer
    if requested_world(cfg) == world and per_node(cfg) == local:
        return []
    if tr.nnodes == 1 and tr.n_gpus_per_node == 1 and cfg.rollout.n_gpus_per_node == 0:
        tr.nnodes, tr.n_gpus_per_node = world // local, local
        return [f"trainer.nnodes={tr.nnodes} trainer.n_gpus_per_node={local}: taken from torchrun ({world} processes)"]
    generating = (f" + rollout.nnodes={cfg.rollout.nnodes} x rollout.n_gpus_per_node={cfg.rollout.n_gpus_per_node}"
                  if cfg.rollout.n_gpus_per_node else "")
    raise ConfigError(f"torchrun started {world} processes ({local} per node) but trainer.nnodes={tr.nnodes} x "
                      f"trainer.n_gpus_per_node={tr.n_gpus_per_node}{generating} = {requested_world(cfg)}; make them "
                      "agree")


def check_launchable(cfg) -> None:
    """What `posttrain train` can start by itself: the processes of one node."""
    tr = cfg.trainer
    if tr.nnodes > 1:
        raise ConfigError(
            f"trainer.nnodes={tr.nnodes}: start posttrain once per node with torchrun, e.g.\n"
            f"  torchrun --nnodes {tr.nnodes} --nproc_per_node {tr.n_gpus_per_node} --rdzv_backend c10d "
            "--rdzv_endpoint HEAD_NODE:29500 --rdzv_id my_run -m posttrain.cli train ...\n"
            "(docs/scaling.md has Slurm and Kubernetes lines)")
    import torch

    if tr.device != "cpu" and torch.cuda.is_available() and torch.cuda.device_count() < per_node(cfg):
        raise ConfigError(f"trainer.n_gpus_per_node={tr.n_gpus_per_node} (+ rollout.n_gpus_per_node="
                          f"{cfg.rollout.n_gpus_per_node}) but this machine has {torch.cuda.device_count()} GPUs")


def launch_local(argv: list[str], nproc: int) -> int:
    """Run `python -m posttrain.cli <argv>` as `nproc` workers of one job (what `torchrun --standalone` does).
    If any worker fails, the launcher stops the others and this raises with the failed rank and its error."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    if "OMP_NUM_THREADS" not in os.environ:  # CPU workers share the cores instead of each taking all of them
        os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // nproc))
    # After SIGTERM/SIGINT the launcher passes the signal on and waits for the workers to finish their step and write
    # the checkpoint; torch's default (30 s) would SIGKILL them mid-step on any real model. The scheduler's own grace
    # period is the limit that matters, and a second signal ends the workers at once.
    os.environ.setdefault("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", str(SHUTDOWN_TIMEOUT_S))
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=str(uuid.uuid4()),
                          rdzv_backend="c10d", rdzv_endpoint="localhost:0", max_restarts=0, monitor_interval=0.5,
                          start_method="spawn")
    from torch.distributed.elastic.multiprocessing.api import SignalException

    try:
        elastic_launch(config, sys.executable)("-m", "posttrain.cli", *argv)
    except SignalException as e:  # the launcher passed the signal on; rank 0 said how to resume
        return 128 + int(e.sigval)
    except ChildFailedError as e:
        rank, message, exitcode = root_cause(e.failures)
        raise WorkerFailed(rank, message, exitcode) from None
    return 0


COMM_SYMPTOMS = ("DistBackendError", "gloo", "NCCL", "Connection closed", "Connection reset")


def root_cause(failures: dict) -> tuple[int, str, int]:
    """The failure that started it: a rank whose error is its own rather than a broken connection to a rank that
    died first or the SIGTERM the launcher sent it (whatever the timestamps say: they are whole seconds, and a rank
    that left no error file is stamped when the launcher next polls, which can be after the rank it took down wrote
    its own); then the earliest, and in the same second a broken connection before a rank the launcher stopped."""
    def message(failure) -> str:
        m = failure.message
        return m if isinstance(m, str) else m.get("message", str(m))

    def order(item):
        rank, failure = item
        stopped = failure.exitcode == -signal.SIGTERM  # what the launcher sends the survivors
        broken = any(s in message(failure) for s in COMM_SYMPTOMS)
        return broken or stopped, failure.timestamp, stopped, broken, rank

    rank, failure = min(failures.items(), key=order)
    return rank, message(failure), failure.exitcode


class WorkerFailed(RuntimeError):
    def __init__(self, rank: int, message: str, exitcode: int):
        super().__init__(f"rank {rank} failed (exit code {exitcode}); every rank was stopped. {message}".strip())
        self.rank, self.exitcode = rank, exitcode
