"""`trainer.*`: processes, run length, validation, checkpoints, logging and the run folder."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from .data import StrOrList
from .watch import WatchConfig


@dataclass
class TrainerConfig:
    project_name: str = "posttrain"
    """name the run folder `checkpoints/{project_name}/{experiment_name}`"""
    experiment_name: str = "run"
    """name the run folder `checkpoints/{project_name}/{experiment_name}`"""
    logger: StrOrList = field(default_factory=lambda: ["console"])
    """any of `console`, `jsonl`, `tensorboard`, `wandb`, `mlflow` (the last two need the `tracking` extra); the
    JSONL metrics file is always written"""
    total_epochs: int = 1
    """passes over the training prompts"""
    total_training_steps: Optional[int] = None
    """stop after this many steps (overrides epochs; >= 1, or null for trainer.total_epochs)"""
    nnodes: int = 1
    """processes of the job; `posttrain train` starts the `n_gpus_per_node` processes of one node itself (on a CPU
    machine: gloo processes); with `nnodes > 1` start it under torchrun on each node (docs/scaling.md). Under
    torchrun left at 1 / 1 they take torchrun's layout"""
    n_gpus_per_node: int = 1
    """processes of the job; `posttrain train` starts the `n_gpus_per_node` processes of one node itself (on a CPU
    machine: gloo processes); with `nnodes > 1` start it under torchrun on each node (docs/scaling.md). Under
    torchrun left at 1 / 1 they take torchrun's layout"""
    device: str = "auto"
    """`auto` (cuda if available), `cpu`, `cuda`"""
    seed: int = 1
    """seed of sampling and initialisation"""
    save_freq: int = -1
    """checkpoint every N steps (and at the end when > 0)"""
    test_freq: int = -1
    """validate every N steps (and at the end when > 0)"""
    val_before_train: bool = True
    """validate before the first step"""
    val_only: bool = False
    """validate the starting weights (or the checkpoint a run resumes from) and stop; needs `data.val_files`"""
    critic_warmup: int = 0
    """steps that update only the critic"""
    balance_batch: bool = True
    """with several processes, give each rank whole prompt groups with near-equal token counts (else consecutive
    groups)"""
    default_local_dir: Optional[str] = None
    """run folder; null = `checkpoints/{project_name}/{experiment_name}`"""
    resume_mode: str = "auto"
    """`auto` (the newest checkpoint of the run folder that loads), `disable` (start over), `resume_path`"""
    resume_from_path: Optional[str] = None
    """checkpoint folder for `resume_path`"""
    overwrite_run_dir: bool = False
    """with `resume_mode=disable`, delete the checkpoints and metrics of a run already in the run folder and start
    over (otherwise that is refused)"""
    resume_allow_config_change: bool = False
    """resume although the config differs from the run's saved `config.yaml` in keys other than run length, logging,
    validation and checkpoint keeping (otherwise refused, naming the keys)"""
    max_actor_ckpt_to_keep: Optional[int] = None
    """keep only the newest N checkpoints (a checkpoint holds both roles; the smaller N wins)"""
    max_critic_ckpt_to_keep: Optional[int] = None
    """keep only the newest N checkpoints (a checkpoint holds both roles; the smaller N wins)"""
    log_val_generations: int = 0
    """validation samples printed and logged per validation"""
    rollout_data_dir: Optional[str] = None
    """dump generations (JSONL) per step / per validation"""
    validation_data_dir: Optional[str] = None
    """dump generations (JSONL) per step / per validation"""
    max_nonfinite_updates_in_a_row: int = 5
    """an optimizer update whose loss or gradient norm is NaN/inf is skipped and counted; the run stops after this
    many skipped updates in a row, naming the quantity that went non-finite first (0 = never stop)"""
    watch: WatchConfig = field(default_factory=WatchConfig)  # the reward-hacking detectors: schema/watch.py
