"""One multi-turn episode: the prompt's token ids, then the tokens after it in spans — the policy's own sampled
tokens (mask 1, with the log-prob each was sampled with) and appended tokens (tool results, environment or user
messages, the chat template's glue between turns; mask 0). A single-turn response is an episode with one span.

The token ids are kept exactly as sampled or appended: nothing is ever re-tokenized. `messages` is the same
conversation as text, for scorers, environments and logs.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Episode:
    prompt_ids: list[int]
    messages: list[dict]  # the conversation so far: the prompt's messages, then assistant / tool / user turns
    row: dict = field(default_factory=dict)  # the data row (data_source, ground_truth, extra_info, agent_name ...)
    tools: list[dict] | None = None  # the JSON schemas offered to the model (the chat template's `tools=`)
    images: dict | None = None  # a vision-language prompt's image inputs (pixel_values, image_grid_thw); else None
    tokens: list[int] = field(default_factory=list)  # every token after the prompt
    mask: list[int] = field(default_factory=list)  # 1: sampled by the policy; 0: appended
    logprobs: list[float] = field(default_factory=list)  # sampling log-prob of each policy token; 0.0 elsewhere
    versions: list[int] = field(default_factory=list)  # partial rollouts: for each policy token the oldest weight
    # version among the keys and values it attended to (the staleness it saw); 0 on appended tokens (masked)
    assistant_turns: int = 0
    user_turns: int = 0
    tool_calls: int = 0
    tool_errors: dict[str, int] = field(default_factory=dict)  # kind of failure -> count (tools/ names the kinds)
    tool_time_s: float = 0.0
    env_reward: float = 0.0  # sum of the rewards the environment gave (added to the episode's reward)
    tool_reward: float = 0.0  # sum of the tools' rewards (recorded, not added: verl's rule; docs/agents.md)
    metrics: dict[str, float] = field(default_factory=dict)  # the environment's own, averaged over its steps
    reward: float | None = None  # an agent program's own reward for it; None: the data_source's scorer scores it
    truncated: bool = False  # stopped by the response budget, not by the policy or the environment
    done: bool = False
    tokenization_mismatch: bool = False  # the kept ids differ from a full re-render (tokenization_sanity_check_mode)
    _metric_steps: dict[str, int] = field(default_factory=dict, repr=False)

    def add_policy(self, tokens: list[int], logprobs: list[float] | None = None,
                   versions: list[int] | None = None) -> None:
        """A turn the policy sampled (its tokens as sampled, the end-of-turn token included when it was sampled), and
        for each the oldest weight version it attended to (partial rollouts; else 0)."""
        self.tokens += tokens
        self.mask += [1] * len(tokens)
        self.logprobs += list(logprobs) if logprobs is not None else [0.0] * len(tokens)
        self.versions += list(versions) if versions is not None else [0] * len(tokens)

    def add_appended(self, tokens: list[int]) -> None:
        """Tokens the policy did not sample: tool results, environment / user messages, template glue."""
        self.tokens += tokens
        self.mask += [0] * len(tokens)
        self.logprobs += [0.0] * len(tokens)
        self.versions += [0] * len(tokens)

    @property
    def response_length(self) -> int:
        """Every token after the prompt, policy and appended alike (what `data.max_response_length` bounds)."""
        return len(self.tokens)

    ENVIRONMENT_COUNTERS = ("tool_calls", "tool_errors", "tool_time_s", "tool_reward")  # what environments write

    def environment_counters(self) -> dict:
        """The counters an environment's `step` keeps on the episode (the tool agent's), to hand to another
        process: under tensor parallel one process of the group runs the environment."""
        return {name: getattr(self, name) for name in self.ENVIRONMENT_COUNTERS}

    def set_environment_counters(self, counters: dict) -> None:
        for name, value in counters.items():
            setattr(self, name, dict(value) if isinstance(value, dict) else value)

    def count_error(self, kind: str) -> None:
        self.tool_errors[kind] = self.tool_errors.get(kind, 0) + 1

    def add_metrics(self, metrics: dict[str, float]) -> None:
        """One environment step's metrics into the episode's: each the mean over the steps that reported it."""
        for key, value in metrics.items():
            seen = self._metric_steps.get(key, 0)
            self.metrics[key] = (self.metrics.get(key, 0.0) * seen + float(value)) / (seen + 1)
            self._metric_steps[key] = seen + 1
