"""The checks and notes of MoE router replay's keys (`actor.router_replay.mode`,
`rollout.enable_rollout_routing_replay`; models/router_replay.py): what R2 and R3 need, and where R3's record
cannot be made."""

from __future__ import annotations

import importlib

from ..models.router_replay import MODES

KEY = "actor_rollout_ref.actor.router_replay.mode"
RECORD = "actor_rollout_ref.rollout.enable_rollout_routing_replay"


def vllm_returns_routing() -> bool:
    """Whether the vLLM engine (rollout.name=vllm) returns the experts of each token it computes."""
    try:
        return bool(getattr(importlib.import_module("posttrain.rollout.vllm"), "RETURNS_ROUTED_EXPERTS", False))
    except ImportError:
        return False


def check_router_replay(cfg, check) -> None:
    """Add the problems of the router replay keys to `check` (validate.Checks)."""
    arr = cfg.actor_rollout_ref
    mode, rollout = arr.actor.router_replay.mode, arr.rollout
    if not check.choice(mode, MODES, KEY):
        return
    if mode == "disabled":
        return
    check(rollout.enable_rollout_routing_replay == (mode == "R3"),
          f"{KEY}={mode} with {RECORD}={rollout.enable_rollout_routing_replay}: R3 replays the routing the rollout "
          f"records, which {RECORD}=True turns on; R2 records it in the old-log-prob pass and takes no rollout "
          "record (as in verl, which refuses R2 with it)")
    check.unsupported(arr.actor.ulysses_sequence_parallel_size <= 1,
                      f"{KEY}={mode} with ulysses_sequence_parallel_size="
                      f"{arr.actor.ulysses_sequence_parallel_size}: a MoE model's routers are not run under sequence "
                      "parallel here")
    if mode != "R3":
        return
    episodes = rollout.multi_turn.enable or rollout.agent.program is not None or bool(cfg.data.environment)
    check.unsupported(not episodes, f"{KEY}=R3 with multi-turn episodes: posttrain's engine records the routing of "
                                    "single-turn rollouts; the episodes' rows replay with R2 (recorded in the "
                                    "old-log-prob pass over them)")
    check.unsupported(rollout.name != "hf", f"{KEY}=R3 with actor_rollout_ref.rollout.name=hf: transformers' generate "
                                            "does not return the experts it routed to; use rollout.name=posttrain")
    check.unsupported(rollout.name != "vllm" or vllm_returns_routing(),
                      f"{KEY}=R3 with actor_rollout_ref.rollout.name=vllm: posttrain's vLLM engine does not return "
                      "the experts each token was routed to (vLLM's routed-experts output is not read); use "
                      "rollout.name=posttrain, whose engine records them, or R2")


def router_replay_notes(cfg) -> list[str]:
    arr = cfg.actor_rollout_ref
    if arr.rollout.enable_rollout_routing_replay and arr.actor.router_replay.mode == "disabled":
        return [f"{RECORD}=True with {KEY}=disabled: the rollout records each token's experts and nothing replays "
                "them (R3 does)"]
    return []
