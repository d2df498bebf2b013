"""Rewards from a scalar reward model, and how they meet the rule scorers.

The rule, as verl's reward managers apply it (they return `rm_scores` as they are when a reward model ran): the
reward model's score is the training reward, on the last response token. Rule scoring (custom_reward_function, or
the data_source's scorer) runs beside it only when it can score every row — a custom function is set, or every
data source has a scorer — and then only feeds the metrics (`reward/acc/mean`, `reward/rule_score/mean`, the
scorer's own keys), gdpo's reward components and validation, which stays rule-based as in verl. DAPO's overlong
shaping, when on, is added to the reward model's score.
"""

from __future__ import annotations

import warnings
from typing import Callable

import torch

from ..data.batch import Batch
from .manager import RewardManager, place_reward, response_texts
from .registry import default_compute_score, has_scorer


class ModelRewardManager:
    """`(batch) -> (token_level_scores, extras)` like RewardManager; `score_fn(batch) -> (B,)` is the reward
    model's pass (RewardModel.score), called on every rank at once."""

    def __init__(self, rule: RewardManager, score_fn: Callable[[Batch], torch.Tensor] | None):
        self.rule, self.score_fn = rule, score_fn
        self.rule_scoring = True  # until a data source without a scorer is seen (check_data_sources)
        self.logged: set[str] = set()

    def check_data_sources(self, sources) -> None:
        """Rows need no rule scorer here: a data source without one turns rule scoring off (the reward model
        alone scores; validation then has nothing to report)."""
        if self.rule.compute_score is default_compute_score:
            self.rule_scoring = self.rule_scoring and all(has_scorer(s) for s in set(sources))

    def __call__(self, batch: Batch) -> tuple[torch.Tensor, dict[str, list]]:
        extras = self.rule_extras(batch)
        rm = self.score_fn(batch).float()
        bad = ~torch.isfinite(rm)
        if bad.any():  # a NaN/inf model score is contained like a rule scorer's: 0, counted, logged once
            if "rm_nonfinite" not in self.logged:
                self.logged.add("rm_nonfinite")
                warnings.warn(f"the reward model gave {int(bad.sum())} non-finite scores in a batch of {len(rm)} "
                              "(scored 0, counted in reward/errors; logged once)", RuntimeWarning, stacklevel=2)
            rm = torch.where(bad, torch.zeros_like(rm), rm)
            extras["errors"] = [e + float(b) for e, b in zip(extras["errors"], bad.tolist())]
        extras["rm_score"] = rm.tolist()
        return self.placed(batch, rm, extras)

    def rule_extras(self, batch: Batch) -> dict[str, list]:
        """The rule scorer's extras with its score as `rule_score` when rule scoring is on; else only the response
        texts. `errors` / `timeouts` are always there (zeros where nothing failed)."""
        extras: dict[str, list] = {}
        if self.rule_scoring:
            _, extras = self.rule(batch)
            extras["rule_score"] = extras["score"]
            extras.pop("overlong_penalty", None)  # recomputed in placed(), on the model's score
        else:
            extras["response_text"] = response_texts(self.rule.tokenizer, batch)
        extras.setdefault("errors", [0.0] * len(batch))
        extras.setdefault("timeouts", [0.0] * len(batch))
        return extras

    def placed(self, batch: Batch, scores: torch.Tensor, extras: dict[str, list]):
        """(token_level_scores, extras): `scores` (the training reward before shaping, kept as extras' `score` for
        rollout dumps and filter_groups) plus an episode's env_reward and DAPO's overlong shaping, on the last
        policy token (`place_reward`)."""
        extras["score"] = scores.tolist()
        return place_reward(batch, scores, extras, self.rule.overlong, self.rule.log_overlong), extras

    def close(self) -> None:
        self.rule.close()
