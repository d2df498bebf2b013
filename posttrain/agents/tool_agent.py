"""The `tool_agent` environment (verl's name): the model calls the run's tools until it writes a turn without a
call; and `single_turn_agent`: one assistant turn, no tools.

tool_agent: `reset(row)` gives the row's prompt messages and the tools' schemas and opens the episode's tool session
(stateful tools created with the row's `extra_info.tools_kwargs`). `step(episode)` parses the last assistant
message (`settings.format`); a turn without a call ends the episode (the tools' `calc_reward` sum is recorded);
otherwise the calls run (`max_parallel_calls`, `tool_timeout_s` each) and their results are the messages appended.
Tools' rewards (`execute`'s and `calc_reward`'s) are recorded as the episode's `tool_reward` and passed to
the scorer in `extra_info["tool_reward"]`, not added to the episode's reward: verl records them the same way, so a
ported tool recipe trains on the same reward (a scorer that wants them adds them). The episode counts its calls, each failure by kind
(`tool_errors`, kinds in posttrain/tools/toolbox.py), and `tool_time_s`, the time it waited for its tools.

The settings are the run's `AgentSettings` (any object with its attribute names); the tools are loaded once per
distinct tool settings and shared by the episodes.
"""

from __future__ import annotations

import json
import threading
import time

from ..tools.parse import parse_tool_calls
from ..tools.toolbox import DEFAULTS, ToolBox
from .environment import Reset, Step, register_environment
from .episode import Episode

_toolboxes: dict[tuple, ToolBox] = {}
_lock = threading.Lock()


def toolbox_for(settings) -> ToolBox:
    """The run's toolbox (loaded on first use)."""
    key = tuple(getattr(settings, name, default) for name, default in DEFAULTS.items())
    with _lock:
        if key not in _toolboxes:
            _toolboxes[key] = ToolBox.from_settings(settings)
        return _toolboxes[key]


def prompt_messages(row: dict) -> list[dict]:
    """The conversation a row starts with: its chat messages (`raw_prompt`, verl's `prompt`, or `messages`)."""
    for key in ("raw_prompt", "prompt", "messages"):
        messages = row.get(key)
        if isinstance(messages, str):
            return [{"role": "user", "content": messages}]
        if messages is not None and len(messages):
            return [dict(m) for m in messages]
    raise ValueError(f"the row has no prompt messages (raw_prompt, prompt or messages); keys: {sorted(row)}")


def tools_kwargs_of(row: dict) -> dict:
    """The row's `extra_info.tools_kwargs` (a JSON string of it too, as some data files keep it)."""
    extra = row.get("extra_info") or {}
    kwargs = extra.get("tools_kwargs") or row.get("tools_kwargs") or {}
    return json.loads(kwargs) if isinstance(kwargs, str) else kwargs


@register_environment("tool_agent")
class ToolAgent:
    def __init__(self, settings):
        self.settings = settings
        self.toolbox = toolbox_for(settings)
        self.session = None

    def reset(self, row: dict) -> Reset:
        self.session = self.toolbox.open(tools_kwargs_of(row))
        return Reset(prompt_messages(row), self.toolbox.schemas() or None)

    def step(self, episode: Episode) -> Step:
        last = episode.messages[-1] if episode.messages else {}
        text = last.get("content") if last.get("role") == "assistant" else None
        calls = parse_tool_calls(text or "", getattr(self.settings, "format", "hermes")).calls
        if not calls:
            reward = self.session.reward()
            self.session.close()
            self._count_session_errors(episode)
            episode.tool_reward += reward
            return Step(done=True)
        started = time.monotonic()
        results = self.session.run(calls, max_parallel_calls=getattr(self.settings, "max_parallel_calls", None),
                                   timeout_s=getattr(self.settings, "tool_timeout_s", None))
        episode.tool_time_s += time.monotonic() - started
        episode.tool_calls += len(calls)
        for result in results:
            if result.error:
                episode.count_error(result.error)
        self._count_session_errors(episode)
        episode.tool_reward += sum(r.reward for r in results)
        return Step([r.message for r in results], metrics=_mean_metrics([r.metrics for r in results]))

    def close(self) -> None:
        if self.session is not None:
            self.session.close()

    def _count_session_errors(self, episode: Episode) -> None:
        for kind, n in self.session.take_errors().items():
            episode.tool_errors[kind] = episode.tool_errors.get(kind, 0) + n


def _mean_metrics(all_metrics: list[dict]) -> dict[str, float]:
    """The mean of each numeric metric the calls reported."""
    sums: dict[str, list[float]] = {}
    for metrics in all_metrics:
        for key, value in metrics.items():
            if isinstance(value, (int, float)):
                sums.setdefault(f"tool/{key}", []).append(float(value))
    return {key: sum(values) / len(values) for key, values in sums.items()}


@register_environment("single_turn_agent")
class SingleTurnAgent:
    def __init__(self, settings=None):
        self.settings = settings

    def reset(self, row: dict) -> Reset:
        return Reset(prompt_messages(row))

    def step(self, episode: Episode) -> Step:
        return Step(done=True)

    def close(self) -> None:
        pass
