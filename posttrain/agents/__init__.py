"""Multi-turn episodes: the policy writes a turn, an environment (tools, a game, a user simulator) answers, the
policy continues. episode.py holds what one episode is; environment.py the interface and registry of what answers
the policy."""

from . import envs, tool_agent  # noqa: F401,E402  (registers the built-in environments)
