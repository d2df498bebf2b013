"""Tools a policy calls in multi-turn episodes: their schemas, how calls are parsed from its text, and how they run.

parse.py reads the calls from a turn; function.py and stateful.py are the two kinds of tool (plain functions marked
with `function_tool`, and verl-style classes from a tool YAML); toolbox.py runs an episode's calls (runner.py: threads
with time limits; answers.py: argument checks, return values, truncation); builtin/ holds the tools verl's example
configs name."""

from .function import ToolLoadError, function_tool
from .parse import ParsedTurn, ToolCall, parse_tool_calls
from .stateful import BaseTool, ToolResponse
from .toolbox import ToolBox, ToolResult, ToolSession

__all__ = ["BaseTool", "ParsedTurn", "ToolBox", "ToolCall", "ToolLoadError", "ToolResponse", "ToolResult",
           "ToolSession", "function_tool", "parse_tool_calls"]
