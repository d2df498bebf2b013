"""`posttrain episodes RUN_DIR`: the logged episodes of a step (agents/episode_log.py), readable — a header per
episode (reward, turns, tool calls and errors, truncation), then each message under its role. Roles are coloured on a
terminal; in a pipe or a file the text is plain."""

from __future__ import annotations

import json
from pathlib import Path

from rich.console import Console
from rich.text import Text

from ..agents.episode_log import read_episodes

ROLE_STYLES = {"system": "dim", "user": "bold green", "assistant": "bold cyan", "tool": "bold yellow"}


def _content(message: dict) -> str:
    """A message's text: plain content, the text parts of a multimodal one, and structured tool calls if any."""
    content = message.get("content")
    if isinstance(content, list):
        content = "".join(part.get("text", f"<{part.get('type', 'part')}>") if isinstance(part, dict) else str(part)
                          for part in content)
    text = "" if content is None else str(content)
    for call in message.get("tool_calls") or ():
        text += ("\n" if text else "") + json.dumps(call.get("function", call), ensure_ascii=False)
    return text


def _header(record: dict) -> str:
    reward, turns = record.get("reward", {}), record.get("turns", {})
    total, score, env = (reward.get(key, 0) for key in ("total", "score", "env_reward"))
    parts = [f"reward {total:g} (score {score:g} + env {env:g})",
             f"turns {turns.get('assistant', 0)}", f"tool calls {record.get('tool_calls', 0)}"]
    errors = record.get("tool_errors") or {}
    if errors:
        parts.append("tool errors: " + ", ".join(f"{kind} {n}" for kind, n in sorted(errors.items())))
    if record.get("truncated"):
        parts.append("truncated")
    if record.get("tokenization_mismatch"):
        parts.append("tokenization mismatch")
    if record.get("ground_truth") is not None:
        parts.append(f"ground truth {record['ground_truth']}")
    return " · ".join(parts)


def print_episode(console: Console, record: dict, title: str) -> None:
    console.rule(Text(title), style="dim")
    console.print(Text(_header(record), style="dim"), soft_wrap=True)
    for message in record.get("messages", []):
        role = str(message.get("role", "?"))
        label = f"{role} {message['name']}" if role == "tool" and message.get("name") else role
        line = Text(f"[{label}]", style=ROLE_STYLES.get(role, "bold"))
        line.append(" " + _content(message))
        console.print(line, soft_wrap=True)


def show_episodes(run_dir: str | Path, step: int | None = None, index: int | None = None, limit: int = 10,
                  console: Console | None = None) -> None:
    """Print episode `index` of `step` (default: the latest logged step), or its first `limit` episodes.
    Raises agents.episode_log.NoEpisodes (with what the folder holds) or IndexError."""
    console = console or Console(highlight=False)
    step, records = read_episodes(run_dir, step)
    if index is not None:
        if not 0 <= index < len(records):
            raise IndexError(f"step {step} logged {len(records)} episodes: --index takes 0 to {len(records) - 1}")
        chosen = [index]
    else:
        chosen = list(range(min(limit, len(records))))
    for i in chosen:
        record = records[i]
        source = " · ".join(str(x) for x in (record.get("data_source"), record.get("agent_name")) if x)
        title = f"step {step} · episode {i} of {len(records)}" + (f" · {source}" if source else "")
        print_episode(console, record, title)
    if index is None and len(records) > len(chosen):
        console.print(Text(f"{len(chosen)} of {len(records)} episodes shown (--limit K, --index I for others)",
                           style="dim"))
