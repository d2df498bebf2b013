"""The episode log: what the agents did at a step, one JSON line per episode, in `RUN_DIR/episodes/step_N.jsonl`.

A line holds the conversation (`messages`: the prompt's, then every assistant turn with its tool calls as the model
wrote them, and the tool / user messages that answered), the reward (`score` from the data_source's scorer,
`env_reward` from the environment and its tools, `total` = their sum, as trained on), the turns, tool calls, tool
errors by kind, whether the episode was truncated, and the row's `data_source`, `ground_truth` and `agent_name`.
A file is written whole to a temporary name and renamed, so a reader never sees half of one.
`posttrain episodes RUN_DIR` prints them (trainer/episodes.py)."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from .episode import Episode

FOLDER = "episodes"
_STEP_FILE = re.compile(r"step_(\d+)\.jsonl")


def episodes_file(run_dir: str | Path, step: int) -> Path:
    """Where the episodes of `step` go: RUN_DIR/episodes/step_N.jsonl."""
    return Path(run_dir) / FOLDER / f"step_{step}.jsonl"


def _plain(value):
    """JSON for what rows and messages may hold besides JSON types: numpy values, bytes (images), anything else."""
    if hasattr(value, "tolist"):
        return value.tolist()
    if isinstance(value, (bytes, bytearray)):
        return f"<{len(value)} bytes>"
    return str(value)


def episode_record(episode: Episode, reward, tokenizer=None) -> dict:
    """One episode as a JSON-ready dict. `reward`: the data_source scorer's score, a number or its dict (with
    `score`; its other keys are kept beside it)."""
    scored = dict(reward) if isinstance(reward, dict) else {"score": reward}
    score = float(scored.pop("score"))
    row = episode.row
    record = {
        "data_source": row.get("data_source"),
        "ground_truth": row.get("ground_truth"),
        "agent_name": row.get("agent_name"),
        "messages": episode.messages,
        "reward": {"score": score, "env_reward": float(episode.env_reward),
                   "total": score + float(episode.env_reward), **scored},
        "turns": {"assistant": episode.assistant_turns, "user": episode.user_turns},
        "tool_calls": episode.tool_calls,
        "tool_errors": dict(episode.tool_errors),
        "tool_time_s": episode.tool_time_s,
        "truncated": episode.truncated,
        "tokenization_mismatch": episode.tokenization_mismatch,
        "response_tokens": len(episode.tokens),
        "policy_tokens": sum(episode.mask),
        "metrics": dict(episode.metrics),
    }
    if tokenizer is not None:  # the response as the scorer read it: every token after the prompt
        record["response"] = tokenizer.decode(episode.tokens, skip_special_tokens=True)
    return record


def write_episodes(path: str | Path, episodes: list[Episode], rewards: list, tokenizer=None) -> Path:
    """Write `episodes` (with each one's scorer reward, see `episode_record`) as JSON lines to `path`, atomically
    (a temporary file renamed into place). The trainer calls it on rank 0 with the validation episodes:
    `write_episodes(episodes_file(run_dir, step), episodes, scores, tokenizer)`."""
    if len(rewards) != len(episodes):
        raise ValueError(f"{len(episodes)} episodes but {len(rewards)} rewards")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps(episode_record(ep, r, tokenizer), default=_plain, ensure_ascii=False)
             for ep, r in zip(episodes, rewards)]
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    os.replace(tmp, path)
    return path


class NoEpisodes(LookupError):
    """A run folder (or step) without an episode log; the message says what is there instead."""


def logged_steps(run_dir: str | Path) -> list[int]:
    """The steps with an episode log in `run_dir`, ascending."""
    folder = Path(run_dir) / FOLDER
    found = (_STEP_FILE.fullmatch(p.name) for p in folder.iterdir()) if folder.is_dir() else ()
    return sorted(int(m.group(1)) for m in found if m)


def read_episodes(run_dir: str | Path, step: int | None = None) -> tuple[int, list[dict]]:
    """(step, records) of `step`'s log, the latest step's by default."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise NoEpisodes(f"{run_dir} is not a folder")
    steps = logged_steps(run_dir)
    if not steps:
        held = sorted(p.name + ("/" if p.is_dir() else "") for p in run_dir.iterdir())
        raise NoEpisodes(f"no episodes in {run_dir}: it has no {FOLDER}/step_N.jsonl (written at each validation of a "
                         f"multi-turn run). It holds: {', '.join(held) if held else 'nothing'}")
    if step is None:
        step = steps[-1]
    elif step not in steps:
        raise NoEpisodes(f"no episodes of step {step} in {run_dir}; steps with episodes: "
                         f"{', '.join(map(str, steps))}")
    text = episodes_file(run_dir, step).read_text(encoding="utf-8")
    return step, [json.loads(line) for line in text.splitlines() if line.strip()]
