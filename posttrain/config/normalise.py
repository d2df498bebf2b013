"""Values a loaded config settles before it is checked: one spelling for a key that takes several, and the layouts
that map onto posttrain's. The loader runs this between building the config and validating it, so validation reads
a config and never changes it."""

from __future__ import annotations

from .schema import Config

ENVIRONMENT_PROGRAM = "posttrain.agents.verifiers_env:run_episode"  # the agent program of data.environment
# SGLang's tool-call parser names (verl's SGLang rollout passed multi_turn.format on to it) for the hermes format
TOOL_CALL_FORMAT_ALIASES = {"qwen": "hermes", "qwen25": "hermes"}


def normalise(cfg: Config) -> Config:
    """Settle `cfg` in place (and return it)."""
    tr = cfg.trainer
    tr.logger = [tr.logger] if isinstance(tr.logger, str) else list(tr.logger)
    if "file" in tr.logger:  # the newest tree's JSON-lines file logger = posttrain's jsonl (metrics.jsonl)
        tr.logger = list(dict.fromkeys("jsonl" if name == "file" else name for name in tr.logger))
        _note(cfg, "trainer.logger entry file -> jsonl", "JSON lines of each step's metrics, metrics.jsonl in the run "
              "directory")
    if cfg.actor_rollout_ref.actor.strategy == "fsdp_turbo":  # FSDP2 with the engine's own wrap and recompute plans
        cfg.actor_rollout_ref.actor.strategy = "fsdp2"
        _note(cfg, "actor_rollout_ref.actor.strategy=fsdp_turbo -> fsdp2", "FSDP2 with its own wrap and recompute "
              "plans; posttrain's FSDP2 shards each decoder layer (turbo_config.* keys: their notes say how)")
    arr = cfg.actor_rollout_ref
    world, tp = tr.nnodes * tr.n_gpus_per_node, arr.actor.fsdp_config.tp_size
    layout_fits = tr.nnodes >= 1 and tr.n_gpus_per_node >= 1 and tp >= 1 and world % tp == 0
    lora = arr.model.lora_rank > 0 or arr.model.lora_adapter_path
    if layout_fits and tp > 1 and lora and arr.actor.strategy == "megatron":
        arr.actor.fsdp_config.tp_size = 1  # a Megatron LoRA layout: its tensor-parallel devices shard with FSDP2
    if arr.actor.strategy == "megatron" and tp > 1 and arr.actor.ulysses_sequence_parallel_size > 1:
        _context_ranks_as_replicas(cfg)
    if layout_fits:
        _whole_shard_with_sequence_parallel(cfg, world // tp)
    _async_layout(cfg)
    mt = arr.rollout.multi_turn
    if mt.format in TOOL_CALL_FORMAT_ALIASES:
        _note(cfg, f"actor_rollout_ref.rollout.multi_turn.format={mt.format} -> hermes", "SGLang's name for the "
              "<tool_call>{\"name\": ..., \"arguments\": ...}</tool_call> format of the Qwen chat templates")
        mt.format = TOOL_CALL_FORMAT_ALIASES[mt.format]
    _legacy_rejection(cfg)
    if cfg.data.environment and arr.rollout.agent.program is None:
        arr.rollout.agent.program = ENVIRONMENT_PROGRAM  # the environment's rollouts are its episodes
    return cfg


def _context_ranks_as_replicas(cfg: Config) -> None:
    """A Megatron layout with tensor and context parallel: Ulysses sequence parallel does not run beside tensor
    parallel here (both split the attention heads), so the context ranks hold the same rows as the pipeline ranks
    do, which keeps Megatron's data-parallel size."""
    actor = cfg.actor_rollout_ref.actor
    cp = actor.ulysses_sequence_parallel_size
    actor.row_replicas *= cp
    actor.ulysses_sequence_parallel_size = 1
    _note(cfg, f"megatron.context_parallel_size={cp} with tensor parallel {actor.fsdp_config.tp_size} -> "
               f"actor_rollout_ref.actor.row_replicas={actor.row_replicas}", "Ulysses sequence parallel does not run "
          "beside tensor parallel; the context ranks hold the same rows, which keeps Megatron's data-parallel size")


def _whole_shard_with_sequence_parallel(cfg: Config, ranks: int) -> None:
    """verl counts `fsdp_size` over every rank, sequence-parallel ones included; a size equal to all of them (8 of 8
    processes with Ulysses 2) is one group over every rank: posttrain's -1 (its fsdp_size counts data-parallel ranks,
    and sequence parallel shards over every data x sequence rank)."""
    arr = cfg.actor_rollout_ref
    if arr.actor.ulysses_sequence_parallel_size <= 1 or arr.actor.fsdp_config.fsdp_size != ranks:
        return
    for fsdp in (arr.actor.fsdp_config, arr.ref.fsdp_config, cfg.critic.model.fsdp_config):
        if fsdp.fsdp_size == ranks:
            fsdp.fsdp_size = -1
    _note(cfg, f"fsdp_config.fsdp_size={ranks} -> -1", "with sequence parallel, a shard group of every rank")


def _legacy_rejection(cfg: Config) -> None:
    """verl's former `rollout_rs=token|sequence|geometric` (ratio bounds rollout_rs_threshold_lower to
    rollout_rs_threshold, or rollout_is_threshold when that is null) as today's k1 option and range. A value that
    does not translate is left for validation to name."""
    from ..algo.rollout_correction import LEGACY_RS, legacy_rejection

    rc = cfg.algorithm.rollout_correction
    if rc.rollout_rs not in LEGACY_RS:
        return
    upper = rc.rollout_rs_threshold if rc.rollout_rs_threshold is not None else rc.rollout_is_threshold
    try:
        option, threshold = legacy_rejection(rc.rollout_rs, float(upper), rc.rollout_rs_threshold_lower)
    except (TypeError, ValueError):
        return
    _note(cfg, f"algorithm.rollout_correction.rollout_rs={rc.rollout_rs} -> {option}, rollout_rs_threshold="
               f"{threshold}", "verl's former rejection levels: the ratio bounds as a k1 range")
    rc.rollout_rs, rc.rollout_rs_threshold, rc.rollout_rs_threshold_lower = option, threshold, None


def _async_layout(cfg: Config) -> None:
    """verl's fully asynchronous sizes: `data.train_batch_size=0` = require_batches mini-batches per step, and
    `rollout.total_rollout_steps` prompts in all = that many steps' batches."""
    at, d, tr = cfg.async_training, cfg.data, cfg.trainer
    if cfg.rollout.n_gpus_per_node <= 0:
        return
    mini = cfg.actor_rollout_ref.actor.ppo_mini_batch_size
    if d.train_batch_size == 0 and at.require_batches >= 1 and mini >= 1:
        d.train_batch_size = at.require_batches * mini
        _note(cfg, f"data.train_batch_size=0 -> {d.train_batch_size}", "a training step takes "
              "async_training.require_batches x ppo_mini_batch_size prompts")
    total = cfg.rollout.total_rollout_steps
    if total is not None and tr.total_training_steps is None and d.train_batch_size > 0 and total >= d.train_batch_size:
        tr.total_training_steps = total // d.train_batch_size
        _note(cfg, f"rollout.total_rollout_steps={total} -> trainer.total_training_steps={tr.total_training_steps}",
              "prompts in all, over steps of data.train_batch_size prompts")


def _note(cfg: Config, what: str, why: str) -> None:
    """Say that a value was read as one of posttrain's (printed once when the config loads)."""
    notes = cfg.__dict__.setdefault("port_notes", {})
    notes.setdefault(f"read as posttrain's keys ({why})", []).append(what)
