"""An agent program's recorded calls -> training samples (Episodes), by one rule: a call whose prompt ids start with a
trajectory's prompt + every token it holds so far continues that trajectory — the tokens between (tool results, the
chat template's glue, whatever the program added) are appended with mask 0, the completion joins as policy tokens with
its log-probs. Any other call (the first one, a rewritten or summarised history, a second conversation) starts a new
trajectory. The most recent trajectory is tried first, then the earlier ones, so two conversations a program
interleaves stay apart.

The response budget (`data.max_response_length`, every token after the prompt) holds per trajectory as in the
episode loop: a completion that would pass it is cut and the trajectory marked `truncated`; tokens to append that
would reach it end the trajectory (`truncated`, nothing appended); later calls that continue a truncated trajectory
add nothing to it. A trajectory without any policy token is no sample.
"""

from __future__ import annotations

from typing import Callable, Protocol, Sequence

from .episode import Episode


class RecordedCall(Protocol):
    """What the server records for one choice of one request (serve/recorder.py `Call`)."""

    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    finish_reason: str


def trajectories(calls: Sequence[RecordedCall], budget: int, *, row: dict | None = None,
                 decode: Callable[[list[int]], str] | None = None) -> list[Episode]:
    """The samples of one program run, in the order their trajectories started. `decode` (ids -> text without
    special tokens) fills each sample's `messages`: the row's prompt messages, then each completion as an assistant
    turn, with the appended tokens between as an `appended` message; without it, messages hold the prompt only."""
    if budget < 1:
        raise ValueError(f"the response budget must be >= 1 token, got {budget}")
    row = row or {}
    episodes: list[Episode] = []
    for i, call in enumerate(calls):
        prompt, completion, logprobs = list(call.prompt_ids), list(call.completion_ids), list(call.logprobs)
        if len(logprobs) != len(completion):
            raise ValueError(f"call {i}: {len(completion)} completion ids but {len(logprobs)} log-probs")
        ep = next((e for e in reversed(episodes) if _continues(e, prompt)), None)
        if ep is None:
            ep = Episode(prompt_ids=prompt, messages=[dict(m) for m in row.get("prompt") or ()], row=row)
            episodes.append(ep)
        if ep.truncated:
            continue
        gap = prompt[len(ep.prompt_ids) + len(ep.tokens):]
        room = budget - len(ep.tokens)
        if gap and len(gap) >= room:
            ep.truncated = True
            continue
        if gap:
            ep.add_appended(gap)
            if decode is not None:
                ep.messages.append({"role": "appended", "content": decode(gap)})
        kept = room - len(gap)
        if len(completion) > kept:
            completion, logprobs, ep.truncated = completion[:kept], logprobs[:kept], True
        ep.add_policy(completion, logprobs)
        ep.assistant_turns += 1
        if decode is not None:
            ep.messages.append({"role": "assistant", "content": decode(completion)})
    for ep in episodes:
        ep.done = True
    return [ep for ep in episodes if any(ep.mask)]


def _continues(ep: Episode, prompt: list[int]) -> bool:
    held = len(ep.prompt_ids) + len(ep.tokens)
    start = len(ep.prompt_ids)
    return len(prompt) >= held and prompt[:start] == ep.prompt_ids and prompt[start:held] == ep.tokens
