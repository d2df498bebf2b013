"""The calculator of the tool task (data/synthetic_tools.py) as a function tool file: the file
`actor_rollout_ref.rollout.multi_turn.function_tool_path` names for that task."""

from posttrain.data.calculator import calculate
from posttrain.tools import function_tool


@function_tool
def calculator(expression: str) -> str:
    """Evaluate integer arithmetic exactly.

    Args:
        expression: integers combined with + - * / // and parentheses, e.g. "1234*567".
    """
    return calculate(expression)
