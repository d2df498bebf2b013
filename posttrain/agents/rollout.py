"""Multi-turn rollouts for the trainer: a batch of prompts in, the batch of finished episodes out, in the layout
training consumes (docs/agents.md, "Masks")."""

from __future__ import annotations

import torch

from ..data.batch import Batch
from ..models.vision import MM_KEY
from ..rollout.base import SamplingParams
from .episode import Episode

ROW_KEYS = ("data_source", "ground_truth", "extra_info", "raw_prompt", "agent_name", "uid", MM_KEY)


def rows_of(batch: Batch) -> list[dict]:
    """Each prompt's row as environments see it: `prompt` (its messages) and the meta the batch carries (a
    vision-language prompt's image inputs under MM_KEY)."""
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
    `rollout_log_probs` with `sampling.logprobs`, `rollout_versions` with partial rollouts; meta `episode` (the
    Episode objects) and `env_reward` (and a vision-language prompt's image inputs, MM_KEY, kept from `batch`:
    the log-prob passes see the images the episodes were decoded with).
    Agent programs that all failed give a batch of no row: the other ranks may have samples to train on, so the
    decision waits for the gathered batch (`require_samples`) rather than raising on this rank alone."""
    rows = rows_of(batch)
    episodes = runner.run(rows, sampling.n, sampling)
    source = {id(row): i for i, row in enumerate(rows)}
    return episodes_batch(batch.select([source[id(e.row)] for e in episodes]), episodes, runner.engine.pad_id,
                          logprobs=sampling.logprobs,
                          versions=getattr(runner.engine, "between_steps", None) is not None)


def require_samples(gathered: Batch, prompts: int) -> Batch:
    """`gathered` (every rank's samples of a step), or a RuntimeError when it holds none: every rank holds the same
    gathered batch, so every rank stops here with this same error. A batch with rows trains on them; the runs that
    gave none are counted (agent/program_errors, agent/program_no_calls)."""
    if len(gathered) == 0:
        raise RuntimeError(f"no sample on any rank from the episodes of this step's {prompts} prompts (agent "
                           "programs: every run failed or made no call; the warnings above and the agent/program_* "
                           "counts say why)")
    return gathered


def episodes_batch(out: Batch, episodes: list[Episode], pad_id: int, *, logprobs: bool,
                   versions: bool = False) -> Batch:
    """`out` (one row per episode, in order) with the episodes' tensors and meta set; no episode: no row. With
    `versions` (partial rollouts) also `rollout_versions`: the weight version that sampled each policy token."""
    B = len(episodes)
    P = max((len(e.prompt_ids) for e in episodes), default=0)
    L = max(1, max((len(e.tokens) for e in episodes), default=0))
    table = lambda xs, width, dtype: torch.tensor(xs, dtype=dtype).reshape(B, width)  # noqa: E731  (B=0 too)
    prompts = table([[pad_id] * (P - len(e.prompt_ids)) + e.prompt_ids for e in episodes], P, torch.long)
    prompt_mask = table([[0] * (P - len(e.prompt_ids)) + [1] * len(e.prompt_ids) for e in episodes], P, torch.long)
    right = lambda xs, fill: [x + [fill] * (L - len(x)) for x in xs]  # noqa: E731
    responses = table(right([e.tokens for e in episodes], pad_id), L, torch.long)
    mask = table(right([e.mask for e in episodes], 0), L, torch.long)
    real = table(right([[1] * len(e.tokens) for e in episodes], 0), L, torch.long)
    out["prompts"], out["prompt_mask"] = prompts, prompt_mask
    out["responses"], out["response_mask"], out["response_attention_mask"] = responses, mask, real
    if logprobs:
        out["rollout_log_probs"] = table(right([e.logprobs for e in episodes], 0.0), L, torch.float32) * mask
    if versions:
        out["rollout_versions"] = table(right([e.versions for e in episodes], 0), L, torch.long) * mask
    out["input_ids"] = torch.cat([prompts, responses], dim=1)
    out["attention_mask"] = torch.cat([prompt_mask, real], dim=1)
    out.meta["episode"] = list(episodes)
    out.meta["env_reward"] = [e.env_reward for e in episodes]
    return out
