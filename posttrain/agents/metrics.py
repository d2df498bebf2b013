"""What a step's episodes did, as `agent/*` metrics: turns, tool calls and their failures, time in tools,
truncation, tokenization mismatches, the environment's rewards and its own metrics.

Computed on the whole step's episodes (every rank's), like every other data metric."""

from __future__ import annotations

from .episode import Episode


def _mean(values) -> float:
    values = list(values)
    return sum(values) / len(values)


def episode_metrics(episodes: list[Episode]) -> dict[str, float]:
    """`agent/*` metrics of finished episodes ({} for none).

    Turns are the policy's (assistant) turns. `agent/tool_errors` is the step's total, `agent/tool_errors/<kind>` the
    total of each kind (`malformed_json`, `unknown_tool`, ...); `agent/tool_time_s` is the mean time an episode
    spent in its tools. An environment metric `m` is logged as `agent/env/m`, averaged over the episodes that
    reported it (an environment used by some rows only is not diluted by the others)."""
    if not episodes:
        return {}
    errors: dict[str, int] = {}
    for ep in episodes:
        for kind, n in ep.tool_errors.items():
            errors[kind] = errors.get(kind, 0) + n
    out = {
        "agent/turns/mean": _mean(ep.assistant_turns for ep in episodes),
        "agent/turns/max": float(max(ep.assistant_turns for ep in episodes)),
        "agent/tool_calls/mean": _mean(ep.tool_calls for ep in episodes),
        "agent/tool_errors": float(sum(errors.values())),
        "agent/tool_time_s": _mean(ep.tool_time_s for ep in episodes),
        "agent/truncated_share": _mean(float(ep.truncated) for ep in episodes),
        "agent/tokenization_mismatch": _mean(float(ep.tokenization_mismatch) for ep in episodes),
        "agent/env_reward/mean": _mean(ep.env_reward for ep in episodes),
        "agent/tool_reward/mean": _mean(ep.tool_reward for ep in episodes),
    }
    out.update({f"agent/tool_errors/{kind}": float(n) for kind, n in sorted(errors.items())})
    env: dict[str, list[float]] = {}
    for ep in episodes:
        for key, value in ep.metrics.items():
            env.setdefault(key, []).append(float(value))
    out.update({f"agent/env/{key}": _mean(values) for key, values in sorted(env.items())})
    return out
