"""Rewards from a generative judge (`reward_model.judge.enable=True`): a causal LM reads a prompt filled from a
template with the question, the response and the reference answer, writes a verdict, and the verdict is parsed into
a score.

How the judge's score meets the rule scores (`reward_model.judge.combine`), with `j` the judge's score and `r` the
rule score of the same response (custom_reward_function, or the data_source's scorer):

- `replace` (default, the scalar reward model's rule): the training reward is `j`; rule scores, when every data
  source has a scorer or a custom function is set, only feed the metrics and validation;
- `add`: `r + j`;  `multiply`: `r * j`;
- `gate`: `j` where `r > 0`, else `r` — the judge grades only the responses the rule passes.

The last three need a rule score for every row. A verdict that cannot be parsed scores `j = 0`, is counted in
`reward/errors` (and its share in `reward/judge_unparsed/mean`) and the first one is logged. DAPO's overlong shaping,
when on, is added to the combined reward. Validation stays rule-based, as with the scalar reward model.
"""

from __future__ import annotations

import math
import re
import string
import warnings
from typing import Callable

import torch

from ..data.batch import Batch
from .manager import RewardManager
from .model import ModelRewardManager
from .registry import load_custom_reward_function

FIELDS = ("question", "response", "ground_truth")
COMBINE = ("replace", "add", "multiply", "gate")

DEFAULT_TEMPLATE = (
    "Question: {question}\n"
    "Reference answer: {ground_truth}\n"
    "Response: {response}\n"
    "Is the final answer of the response correct? Reply with one word: correct or incorrect."
)

# the last "correct" / "incorrect" of the verdict, as a whole word in any case
VERDICT = re.compile(r"\b(correct|incorrect)\b", re.IGNORECASE)


def template_problem(template: str) -> str | None:
    """What keeps `template` from being filled (an unknown or positional placeholder, no `{response}`), or None."""
    try:
        names = [name for _, name, _, _ in string.Formatter().parse(template) if name is not None]
    except ValueError as e:  # a lone brace
        return f"it is not a format string ({e}); write a literal brace as {{{{ or }}}}"
    unknown = sorted({n for n in names if n not in FIELDS})
    if unknown:
        return (f"placeholder(s) {unknown} are not known; the template may use {{question}}, {{response}} and "
                "{ground_truth}")
    if "response" not in names:
        return "it has no {response} placeholder, so the judge would never see the response"
    return None


def fill(template: str, *, question: str, response: str, ground_truth) -> str:
    """The judge's prompt for one response (a missing ground truth fills as an empty string)."""
    truth = "" if ground_truth is None else str(ground_truth)
    return template.format(question=question, response=response, ground_truth=truth)


def question_of(chat) -> str:
    """The question a prompt asks: its last user message (the whole chat's contents when it has none)."""
    turns = list(chat or [])
    users = [m for m in turns if m.get("role") == "user"]
    return str(users[-1]["content"]) if users else "\n".join(str(m.get("content", "")) for m in turns)


def parse_verdict(text: str) -> float | None:
    """The default parser: the last whole word `correct` (1.0) or `incorrect` (0.0) in the verdict; None if
    there is neither."""
    found = VERDICT.findall(text)
    if not found:
        return None
    return 1.0 if found[-1].lower() == "correct" else 0.0


def regex_parser(pattern: str) -> Callable[[str], float | None]:
    """`reward_model.judge.score_regex`: the last match's first group (the whole match without groups), read as
    a number."""
    compiled = re.compile(pattern)

    def parse(text: str) -> float | None:
        matches = list(compiled.finditer(text))
        if not matches:
            return None
        last = matches[-1]
        return float(last.group(1) if compiled.groups else last.group(0))

    return parse


def make_parser(judge_cfg) -> Callable[[str], float | None]:
    """The configured parser: a Python function `parse(text) -> float` from a file, a regex, or the default."""
    fn = judge_cfg.parse_function
    if fn.path:
        return load_custom_reward_function(fn.path, fn.name)
    if judge_cfg.score_regex:
        return regex_parser(judge_cfg.score_regex)
    return parse_verdict


def load_template(judge_cfg) -> str:
    """The configured template: from `prompt_template_path`, `prompt_template`, or the built-in one."""
    if judge_cfg.prompt_template_path:
        with open(judge_cfg.prompt_template_path, encoding="utf-8") as f:
            return f.read()
    return judge_cfg.prompt_template or DEFAULT_TEMPLATE


def combine(mode: str, judge: torch.Tensor, rule: torch.Tensor | None) -> torch.Tensor:
    """The training reward from the judge's scores and the rule scores (see the module docstring)."""
    if mode == "replace":
        return judge
    if rule is None:
        raise ValueError(f"reward_model.judge.combine={mode} needs a rule score for every row")
    if mode == "add":
        return rule + judge
    if mode == "multiply":
        return rule * judge
    if mode == "gate":
        return torch.where(rule > 0, judge, rule)
    raise ValueError(f"reward_model.judge.combine={mode!r} is not one of {list(COMBINE)}")


class JudgeRewardManager(ModelRewardManager):
    """`(batch) -> (token_level_scores, extras)`; `judge_fn(prompts) -> verdicts` is the judge's generation
    (Judge.verdicts), called on every rank at once with that rank's rows."""

    def __init__(self, rule: RewardManager, judge_fn: Callable[[list[str]], list[str]], *,
                 template: str = DEFAULT_TEMPLATE, parse: Callable[[str], float | None] = parse_verdict,
                 combine_mode: str = "replace"):
        super().__init__(rule, score_fn=None)  # the judge's pass is judge_fn; the rule handling is shared
        if combine_mode not in COMBINE:
            raise ValueError(f"reward_model.judge.combine={combine_mode!r} is not one of {list(COMBINE)}")
        problem = template_problem(template)
        if problem:
            raise ValueError(f"reward_model.judge prompt template: {problem}")
        self.judge_fn, self.template, self.parse, self.combine_mode = judge_fn, template, parse, combine_mode

    def check_data_sources(self, sources) -> None:
        super().check_data_sources(sources)
        if self.combine_mode != "replace" and not self.rule_scoring:
            from ..errors import ConfigError

            raise ConfigError(f"reward_model.judge.combine={self.combine_mode} needs a rule score for every row, but "
                              "a data source has no scorer; set custom_reward_function.path, or combine=replace")

    def prompts(self, batch: Batch, responses: list[str]) -> list[str]:
        chats = batch.meta.get("raw_prompt") or [None] * len(batch)
        truths = batch.meta.get("ground_truth") or [None] * len(batch)
        return [fill(self.template, question=question_of(c), response=r, ground_truth=t)
                for c, r, t in zip(chats, responses, truths)]

    def __call__(self, batch: Batch) -> tuple[torch.Tensor, dict[str, list]]:
        extras = self.rule_extras(batch)
        verdicts = self.judge_fn(self.prompts(batch, extras["response_text"]))
        if len(verdicts) != len(batch):
            raise RuntimeError(f"the judge gave {len(verdicts)} verdicts for {len(batch)} responses")
        scores, unparsed = [], []
        for verdict in verdicts:
            score = self._parse(verdict)
            unparsed.append(float(score is None))
            scores.append(0.0 if score is None else score)
        judge = torch.tensor(scores, dtype=torch.float32)
        extras["errors"] = [e + u for e, u in zip(extras["errors"], unparsed)]
        extras["judge_score"], extras["judge_unparsed"] = judge.tolist(), unparsed
        extras["judge_verdict"] = list(verdicts)
        rule = torch.tensor(extras["rule_score"], dtype=torch.float32) if self.rule_scoring else None
        return self.placed(batch, combine(self.combine_mode, judge, rule), extras)

    def _parse(self, verdict: str) -> float | None:
        """The parser's score, or None (unparseable: no verdict, an exception, or no finite number); the first
        failure is logged."""
        try:
            score = self.parse(verdict)
            score = None if score is None else float(score)
        except Exception as e:  # a parser that raises on odd text is one unparseable verdict, not a crash
            score, why = None, f"{type(e).__name__}: {e}"
        else:
            why = "no verdict found"
        if score is not None and not math.isfinite(score):
            score, why = None, "not a finite number"
        if score is None and "judge_unparsed" not in self.logged:
            self.logged.add("judge_unparsed")
            warnings.warn(f"a judge verdict could not be parsed ({why}; scored 0, counted in reward/errors; "
                          f"logged once): {verdict[:300]!r}", RuntimeWarning, stacklevel=3)
        return score


def judge_reward(cfg, rule: RewardManager, judge) -> JudgeRewardManager:
    """The judge's reward manager for `cfg.reward_model.judge`; `judge` is the role (its `verdicts`)."""
    j = cfg.reward_model.judge
    return JudgeRewardManager(rule, judge.verdicts, template=load_template(j), parse=make_parser(j),
                              combine_mode=j.combine)
