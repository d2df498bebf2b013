"""`guess_number`: a feedback-and-retry environment, the smallest game that needs several turns.

The row's `extra_info` holds a secret integer and its range (`secret`, `low`, `high`; `max_guesses` optional). Each
assistant turn's last integer is its guess. The environment answers as the `user`: "higher" or "lower" — or, for a
turn without an integer, what to answer. The episode ends when a guess is right (reward 1) or after `max_guesses`
guesses (reward 0; default: as many as a binary search needs at worst, `floor(log2(high - low + 1)) + 1`, 7 for
1..100). It is deterministic: the same turns get the same answers. Its metric `invalid_guess` is the share of turns
without an integer.

Rows come from `guess_number_rows`; their data_source `guess_number` scores 0, so an episode's reward (score +
env_reward) is the environment's."""

from __future__ import annotations

import random
import re

from ...reward.registry import register_scorer
from ..environment import Reset, Step, register_environment

NAME = "guess_number"
_INTEGER = re.compile(r"-?\d+")


def last_integer(text: str) -> int | None:
    found = _INTEGER.findall(text or "")
    return int(found[-1]) if found else None


def _prompt(low: int, high: int) -> str:
    return (f"I am thinking of an integer between {low} and {high}. Guess it: end each answer with one integer. "
            "I will say higher or lower.")


def guess_number_rows(n: int, low: int = 1, high: int = 100, seed: int = 0,
                      max_guesses: int | None = None) -> list[dict]:
    """`n` rows in the RL data layout (prompt, data_source, reward_model, extra_info, agent_name), secrets drawn
    uniformly from [low, high] with `seed`."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        secret = rng.randint(low, high)
        info = {"index": i, "secret": secret, "low": low, "high": high}
        if max_guesses is not None:
            info["max_guesses"] = max_guesses
        rows.append({"prompt": [{"role": "user", "content": _prompt(low, high)}], "data_source": NAME,
                     "reward_model": {"style": "rule", "ground_truth": str(secret)}, "extra_info": info,
                     "agent_name": NAME})
    return rows


class GuessNumber:
    """One episode of the game (an instance per episode, as every environment)."""

    def reset(self, row: dict) -> Reset:
        info = row.get("extra_info") or {}
        try:
            self.secret, self.low, self.high = int(info["secret"]), int(info["low"]), int(info["high"])
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"a {NAME} row needs integers extra_info.secret, low and high; got {info!r}") from None
        self.max_guesses = int(info.get("max_guesses") or (self.high - self.low + 1).bit_length())
        self.guesses = 0
        messages = row.get("raw_prompt") or row.get("prompt") or [
            {"role": "user", "content": _prompt(self.low, self.high)}]
        return Reset(messages=list(messages))

    def step(self, episode) -> Step:
        guess = last_integer(episode.messages[-1].get("content"))
        self.guesses += 1
        out_of_guesses = self.guesses >= self.max_guesses
        if guess == self.secret:
            return Step(reward=1.0, done=True, metrics={"invalid_guess": 0.0})
        if guess is None:
            answer = f"Answer with one integer between {self.low} and {self.high}."
        else:
            answer = "higher" if guess < self.secret else "lower"
        return Step(messages=[] if out_of_guesses else [{"role": "user", "content": answer}],
                    done=out_of_guesses, metrics={"invalid_guess": float(guess is None)})

    def close(self) -> None:
        pass


@register_environment(NAME)
def make_guess_number(settings=None) -> GuessNumber:
    return GuessNumber()


@register_scorer(NAME)
def score_guess_number(solution_str: str, ground_truth: str, extra_info: dict | None = None) -> float:
    """0: the environment gives this task's reward (1 for the right guess), added to the score by the reward rule."""
    return 0.0
