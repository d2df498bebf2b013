"""The rollout engine a config names (`actor_rollout_ref.rollout.name`), checked when it loads: what vLLM needs and
what it does not run here are refused with the reason; what another engine's keys do here is said once (notes).
docs/rollout_engines.md."""

from __future__ import annotations

from ..rollout.vllm import INSTALL, installed as vllm_installed

ENGINE_KEYS = ("tensor_model_parallel_size", "gpu_memory_utilization", "free_cache_engine", "load_format",
               "max_num_batched_tokens", "max_num_seqs", "enable_chunked_prefill", "max_model_len")
POSTTRAIN_ENGINES = ("posttrain", "hf")
STAND_INS = ("sglang", "trtllm")  # named by verl configs; posttrain's engine generates (a note says so)
ENGINES = (*POSTTRAIN_ENGINES, "vllm", *STAND_INS)
KEY = "actor_rollout_ref.rollout"


def posttrain_instead(cfg) -> str | None:
    """Why `rollout.name=vllm` generates with posttrain's engine in this run (None: vLLM generates). Multi-turn
    episodes run on vLLM (the episode loop sends each turn's conversations to it as token ids), except with a vLLM
    tensor-parallel group; agent programs and
    environments talk to posttrain's server, which decodes on posttrain's engine; asynchronous RL's generating
    process holds no vLLM engine (vLLM builds its process groups from the whole torchrun world, in which the
    training processes would have to take part)."""
    rollout = cfg.actor_rollout_ref.rollout
    if rollout.agent.program is not None or cfg.data.environment is not None:
        return "agent programs and environments' episodes talk to posttrain's server, on posttrain's engine"
    if rollout.multi_turn.enable and rollout.tensor_model_parallel_size > 1:
        return ("multi-turn episodes with a vLLM tensor-parallel group (tensor_model_parallel_size > 1) run on "
                "posttrain's engine: the group's processes generate together, and their episodes end after different "
                "numbers of turns")
    if cfg.rollout.n_gpus_per_node > 0:
        return "asynchronous RL's generating process (rollout.n_gpus_per_node > 0) runs posttrain's engine"
    return None


def engine_name(cfg) -> str:
    """The engine this run generates with: `rollout.name`, or posttrain's where vLLM would not generate."""
    name = cfg.actor_rollout_ref.rollout.name
    return "posttrain" if name == "vllm" and posttrain_instead(cfg) else name


def check_rollout_engine(cfg, check) -> None:
    """Add the problems of the configured engine to `check` (validate.Checks)."""
    rollout = cfg.actor_rollout_ref.rollout
    check.choice(rollout.name, ENGINES, f"{KEY}.name")
    if rollout.name != "vllm" or posttrain_instead(cfg):
        return
    check(vllm_installed(), f"{KEY}.name=vllm: vLLM is not installed here; {INSTALL}. Or generate with posttrain's "
                            f"engine ({KEY}.name=posttrain: faster on a CPU and for small models)",
          "files, models and packages")
    world = cfg.trainer.n_gpus_per_node * cfg.trainer.nnodes
    tp = rollout.tensor_model_parallel_size
    check(tp >= 1 and world % tp == 0, f"{KEY}.tensor_model_parallel_size={tp} must divide the {world} processes "
                                       "(trainer.n_gpus_per_node x trainer.nnodes): vLLM's tensor-parallel groups are "
                                       "consecutive ranks of the training processes")
    check(0 < rollout.gpu_memory_utilization <= 1, f"{KEY}.gpu_memory_utilization={rollout.gpu_memory_utilization} "
                                                   "must lie in (0, 1]")
    check(rollout.max_num_seqs >= 1 and rollout.max_num_batched_tokens >= 1,
          f"{KEY}.max_num_seqs and max_num_batched_tokens must be >= 1")
    needed = cfg.data.max_prompt_length + cfg.data.max_response_length
    length = rollout.max_model_len or needed
    check(length >= needed, f"{KEY}.max_model_len={length} is shorter than a prompt and its response "
                            f"(data.max_prompt_length + max_response_length = {needed})")
    check(rollout.enable_chunked_prefill or rollout.max_num_batched_tokens >= length,
          f"{KEY}.enable_chunked_prefill=False: vLLM prefills each prompt in one step, so max_num_batched_tokens="
          f"{rollout.max_num_batched_tokens} must be >= max_model_len={length}")


def engine_notes(cfg) -> list[str]:
    """What the engine keys do with the configured engine, where they do less than a verl user expects."""
    import torch

    rollout, notes = cfg.actor_rollout_ref.rollout, []
    instead = posttrain_instead(cfg) if rollout.name == "vllm" else None
    if instead:
        notes.append(f"{KEY}.name=vllm: {instead}, not on vLLM (docs/rollout_engines.md); the engine-only keys have "
                     "no effect in this run")
    elif rollout.name in STAND_INS:
        notes.append(f"{KEY}.name={rollout.name}: posttrain generates with its own engine (no {rollout.name} "
                     "here); the engine-only keys have no effect")
    elif rollout.name in POSTTRAIN_ENGINES:
        from .schema.actor_rollout_ref import RolloutConfig

        default = RolloutConfig()
        changed = [k for k in ENGINE_KEYS if getattr(rollout, k) != getattr(default, k)]
        if changed:
            notes.append(f"{KEY}.{', '.join(changed)}: keys of the vLLM engine (rollout.name=vllm), no effect on "
                         f"rollout.name={rollout.name}")
    elif rollout.free_cache_engine:
        device = cfg.trainer.device
        cpu = device == "cpu" or device == "auto" and not torch.cuda.is_available()
        if cpu:
            notes.append(f"{KEY}.free_cache_engine=True does nothing on a CPU: vLLM's CPU worker has no sleep mode, "
                         "so it keeps its weights and KV cache in memory while the trainer runs")
    return notes
