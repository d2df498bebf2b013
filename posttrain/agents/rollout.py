"""Multi-turn rollouts for the trainer: a batch of prompts in, the batch of finished episodes out, in the layout
training consumes (docs/agents.md, "Masks")."""

from __future__ import annotations

import torch

from ..data.batch import Batch
from ..rollout.base import SamplingParams
from .episode import Episode

ROW_KEYS = ("data_source", "ground_truth", "extra_info", "raw_prompt", "agent_name", "uid")


def rows_of(batch: Batch) -> list[dict]:
    """Each prompt's row as environments see it: `prompt` (its messages) and the meta the batch carries."""
    rows = []
    for i in range(len(batch)):
        row = {k: batch.meta[k][i] for k in ROW_KEYS if k in batch.meta}
        row["prompt"] = row.get("raw_prompt")
        rows.append(row)
    return rows


def run_episodes(runner, batch: Batch, sampling: SamplingParams) -> Batch:
    """The episodes of `runner` (an EpisodeRunner: `sampling.n` per prompt; a ProgramRunner: any number per prompt,
    none included) for `batch`'s prompts, as a batch whose rows carry their prompt's meta (its `uid` among them):
    `prompts` / `prompt_mask` the episodes' own prompts (rendered with their tools), `responses` every token after
    the prompt, `response_mask` 1 on policy tokens, `response_attention_mask` 1 on every real token,
    `rollout_log_probs` with `sampling.logprobs`; meta `episode` (the Episode objects) and `env_reward`."""
    rows = rows_of(batch)
    episodes = runner.run(rows, sampling.n, sampling)
    if not episodes:
        raise RuntimeError(f"no sample from any of the {len(rows) * sampling.n} episodes of this step's "
                           f"{len(rows)} prompts (agent programs: every run failed or made no call; the warnings "
                           "above and the agent/program_* counts say why)")
    source = {id(row): i for i, row in enumerate(rows)}
    return episodes_batch(batch.select([source[id(e.row)] for e in episodes]), episodes, runner.engine.pad_id,
                          logprobs=sampling.logprobs)


def episodes_batch(out: Batch, episodes: list[Episode], pad_id: int, *, logprobs: bool) -> Batch:
    """`out` (one row per episode, in order) with the episodes' tensors and meta set."""
    P = max(len(e.prompt_ids) for e in episodes)
    L = max(1, max(len(e.tokens) for e in episodes))
    prompts = torch.tensor([[pad_id] * (P - len(e.prompt_ids)) + e.prompt_ids for e in episodes], dtype=torch.long)
    prompt_mask = torch.tensor([[0] * (P - len(e.prompt_ids)) + [1] * len(e.prompt_ids) for e in episodes])
    right = lambda xs, fill: [x + [fill] * (L - len(x)) for x in xs]  # noqa: E731
    responses = torch.tensor(right([e.tokens for e in episodes], pad_id), dtype=torch.long)
    mask = torch.tensor(right([e.mask for e in episodes], 0), dtype=torch.long)
    real = torch.tensor(right([[1] * len(e.tokens) for e in episodes], 0), dtype=torch.long)
    out["prompts"], out["prompt_mask"] = prompts, prompt_mask
    out["responses"], out["response_mask"], out["response_attention_mask"] = responses, mask, real
    if logprobs:
        out["rollout_log_probs"] = torch.tensor(right([e.logprobs for e in episodes], 0.0), dtype=torch.float32) * mask
    out["input_ids"] = torch.cat([prompts, responses], dim=1)
    out["attention_mask"] = torch.cat([prompt_mask, real], dim=1)
    out.meta["episode"] = list(episodes)
    out.meta["env_reward"] = [e.env_reward for e in episodes]
    return out
