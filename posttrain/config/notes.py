"""Settings accepted so scripts port but with no effect here, or read differently: said once when the config
loads (`config_warnings`), never silently ignored."""

from __future__ import annotations

from .rollout_engine import engine_notes
from .router_replay import router_replay_notes
from .schema import Config
from .schema.actor_rollout_ref import RolloutConfig


LONE_GROUPS = {  # group estimators that verl runs with rollout.n=1, and what a group of one computes there
    "grpo": "a group of one has mean 0 and standard deviation 1 (as in verl), so each response's advantage is its "
            "raw score (divided by 1 + 1e-6)",
    "rloo": "a group of one has no other member to leave out (as in verl), so each response's advantage is its raw "
            "score",
}


def lone_group_note(estimator: str) -> str:
    return (f"algorithm.adv_estimator={estimator} with actor_rollout_ref.rollout.n=1: {LONE_GROUPS[estimator]}: "
            "REINFORCE without a baseline, not a comparison within a group")



def _layout_note(cfg: Config) -> str | None:
    """How a Megatron command line's devices are used here, said once."""
    if "megatron" not in (cfg.actor_rollout_ref.actor.strategy, cfg.critic.strategy):
        return None
    actor = cfg.actor_rollout_ref.actor
    tr, tp, sp, replicas = cfg.trainer, actor.fsdp_config.tp_size, actor.ulysses_sequence_parallel_size, \
        actor.row_replicas
    world = tr.nnodes * tr.n_gpus_per_node
    dp = max(world // max(tp * sp * replicas, 1), 1)
    return (f"strategy=megatron: the {world} processes run tensor parallel {tp} (actor.megatron."
            f"tensor_model_parallel_size) x {replicas} ranks holding the same rows (pipeline_model_parallel_size: "
            f"no pipelining here, they shard the model with FSDP2 and each computes whole rows) x sequence parallel "
            f"{sp} (context_parallel_size, Ulysses) x {dp} data-parallel ranks, Megatron's data-parallel size; "
            "expert parallel has no equivalent (FSDP2 shards the experts with the rest)")


def _multi_turn_notes(rollout: RolloutConfig) -> list[str]:
    """Tools that are set up but that no episode will offer."""
    mt, key = rollout.multi_turn, "actor_rollout_ref.rollout.multi_turn"
    paths = [k for k in ("tool_config_path", "function_tool_path") if getattr(mt, k) is not None]
    if paths and not mt.enable:
        return [f"{key}.{' and '.join(paths)} set, but {key}.enable=False: rollouts are single-turn and offer no "
                "tools"]
    if paths and rollout.agent.default_agent_loop == "single_turn_agent":
        return [f"{key}.{' and '.join(paths)} set with actor_rollout_ref.rollout.agent.default_agent_loop="
                "single_turn_agent: only rows whose agent_name column names tool_agent call the tools"]
    return []


def _gpt_oss_notes(rollout: RolloutConfig) -> list[str]:
    """The tokenization check, which has nothing to compare with in gpt-oss's format."""
    mt, key = rollout.multi_turn, "actor_rollout_ref.rollout.multi_turn"
    if not (mt.enable and mt.format == "gpt-oss" and mt.tokenization_sanity_check_mode != "disable"):
        return []
    return [f"{key}.tokenization_sanity_check_mode={mt.tokenization_sanity_check_mode}: no check with format=gpt-oss "
            "(the tool answers' tokens are written in harmony's format by hand, as verl writes them: the gpt-oss chat "
            "template cannot render them, so there is no rendering to compare with)"]


def _reinforce_notes(cfg: Config) -> list[str]:
    """What loss_type=reinforce does where it does less than the key suggests (verl reads it in bypass mode only,
    where it replaces the configured policy loss)."""
    rc, key = cfg.algorithm.rollout_correction, "algorithm.rollout_correction"
    if rc.loss_type != "reinforce":
        return []
    if not rc.bypass_mode:
        return [f"{key}.loss_type=reinforce: accepted, no effect without {key}.bypass_mode=True (verl reads it in "
                "bypass mode only); the configured policy loss runs"]
    mode = cfg.actor_rollout_ref.actor.policy_loss.loss_mode
    return [f"{key}.loss_type=reinforce: the policy loss is REINFORCE with explicit importance weights "
            f"(docs/algorithms.md), not actor_rollout_ref.actor.policy_loss.loss_mode={mode}"] if mode != "vanilla" \
        else []


def config_warnings(cfg: Config) -> list[str]:
    """Settings that are accepted so scripts port, but have no effect here: said once, never silently ignored."""
    rollout = cfg.actor_rollout_ref.rollout
    notes = engine_notes(cfg)
    notes += _multi_turn_notes(rollout) + _gpt_oss_notes(rollout)
    layout = _layout_note(cfg)
    if layout:
        notes.append(layout)
    if cfg.algorithm.adv_estimator in LONE_GROUPS and rollout.n == 1:
        notes.append(lone_group_note(cfg.algorithm.adv_estimator))
    rc = cfg.algorithm.rollout_correction
    notes += _reinforce_notes(cfg)
    notes += router_replay_notes(cfg)
    if rc.bypass_mode and rc.rollout_is is not None and rc.loss_type == "ppo_clip":
        notes.append(f"algorithm.rollout_correction.rollout_is={rc.rollout_is} with bypass_mode=True: the rollout's "
                     "log-probs are the old policy's, so the loss's ratio pi / pi_rollout corrects for the rollout and "
                     "no importance weights are applied, as in verl's bypass mode with loss_type=ppo_clip (which "
                     "computes them for its metrics only; posttrain reports no rollout_corr/* metrics then)")
    for why, keys in getattr(cfg, "port_notes", {}).items():
        notes.append(f"{', '.join(keys)}: {why}" if why.startswith("read as") else
                     f"accepted, no effect here: {', '.join(keys)} ({why})")
    return notes
