"""The settings of multi-turn episodes, read once from `actor_rollout_ref.rollout.multi_turn.*` and
`actor_rollout_ref.rollout.agent.*` (docs/config.md describes each key)."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import ConfigError


@dataclass(frozen=True)
class AgentSettings:
    format: str = "hermes"
    max_assistant_turns: int | None = None  # None: no limit but the response budget
    max_user_turns: int | None = None
    max_parallel_calls: int = 1
    max_tool_response_length: int = 256
    tool_response_truncate_side: str = "middle"
    tool_config_path: str | None = None
    function_tool_path: str | None = None
    tokenization_sanity_check_mode: str = "strict"
    default_agent_loop: str = "single_turn_agent"
    num_workers: int = 8  # environment steps (tool turns) running at once
    tool_timeout_s: float = 30.0  # each tool call's time limit
    program: str | None = None  # an agent program (program.py) plays the episodes instead of the environments
    program_timeout_s: float = 600.0  # each program run's time limit
    template_kwargs: dict = field(default_factory=dict)  # the chat template's own arguments (enable_thinking, ...)

    @property
    def step_timeout_s(self) -> float:
        """The most one environment step may take: its tool calls, in waves of `max_parallel_calls`, plus slack.
        A step past it ends its episode (counted); the thread is abandoned."""
        return self.tool_timeout_s * 4 + 10.0

    @classmethod
    def from_config(cls, cfg) -> "AgentSettings":
        from .environment import ENVIRONMENTS, register_from_file

        rollout = cfg.actor_rollout_ref.rollout
        mt, agent = rollout.multi_turn, rollout.agent
        if agent.agent_loop_config_path:  # a user's environments, registered in this process too
            try:
                register_from_file(agent.agent_loop_config_path)
            except ValueError as e:
                raise ConfigError(f"actor_rollout_ref.rollout.agent.agent_loop_config_path: {e}") from None
        if agent.default_agent_loop not in ENVIRONMENTS:
            raise ConfigError(f"actor_rollout_ref.rollout.agent.default_agent_loop={agent.default_agent_loop!r}: no "
                              f"such environment (registered: {', '.join(sorted(ENVIRONMENTS))}); an environment of "
                              "your own joins with posttrain.agents.environment.register_environment")
        return cls(format=mt.format, max_assistant_turns=mt.max_assistant_turns, max_user_turns=mt.max_user_turns,
                   max_parallel_calls=mt.max_parallel_calls, max_tool_response_length=mt.max_tool_response_length,
                   tool_response_truncate_side=mt.tool_response_truncate_side, tool_config_path=mt.tool_config_path,
                   function_tool_path=mt.function_tool_path,
                   tokenization_sanity_check_mode=mt.tokenization_sanity_check_mode,
                   default_agent_loop=agent.default_agent_loop, num_workers=agent.num_workers,
                   tool_timeout_s=mt.tool_timeout_s, program=agent.program,
                   program_timeout_s=agent.program_timeout_s,
                   template_kwargs=dict(getattr(cfg.data, "apply_chat_template_kwargs", None) or {}))
