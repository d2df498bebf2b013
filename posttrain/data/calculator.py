"""Integer arithmetic a policy may ask for: `+ - * / //` and parentheses over integer literals, nothing else.

The expression comes from sampled model text, so it is parsed (Python's `ast`), never evaluated: any other syntax
(names, calls, attributes, `**`, floats, strings) is refused, and the sizes are bounded — the text, every literal and
every intermediate result — so no expression costs more than a few microseconds or a few hundred bytes.
"""

from __future__ import annotations

import ast
from fractions import Fraction

MAX_EXPRESSION_CHARS = 200
MAX_DIGITS = 40  # of any literal, and of any intermediate result's numerator and denominator

_OPERATORS = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b,
              ast.Div: lambda a, b: a / b, ast.FloorDiv: lambda a, b: Fraction(a // b)}


class CalculatorError(ValueError):
    """The expression is not integer arithmetic the calculator does, or its result is out of bounds."""


def _bounded(x: Fraction) -> Fraction:
    limit = 10 ** MAX_DIGITS
    if abs(x.numerator) >= limit or x.denominator >= limit:
        raise CalculatorError(f"a number in the calculation has more than {MAX_DIGITS} digits")
    return x


def _value(node: ast.AST, source: str) -> Fraction:
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return _bounded(Fraction(node.value))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        x = _value(node.operand, source)
        return -x if isinstance(node.op, ast.USub) else x
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        a, b = _value(node.left, source), _value(node.right, source)
        if b == 0 and isinstance(node.op, (ast.Div, ast.FloorDiv)):
            raise CalculatorError("division by zero")
        return _bounded(_OPERATORS[type(node.op)](a, b))
    shown = ast.get_source_segment(source, node) or type(node).__name__
    raise CalculatorError(f"only integers, + - * / // and parentheses are allowed, not {shown[:40]!r}")


def calculate(expression: str) -> str:
    """The value of `expression` as text: an integer, or a fraction `p/q` in lowest terms where `/` does not divide
    evenly. CalculatorError for anything else."""
    if not isinstance(expression, str):
        raise CalculatorError(f"the expression must be a string, got {type(expression).__name__}")
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise CalculatorError(f"the expression is longer than {MAX_EXPRESSION_CHARS} characters")
    source = expression.strip()
    try:
        tree = ast.parse(source, mode="eval")
    except (SyntaxError, ValueError, MemoryError, RecursionError) as e:  # ValueError: a NUL byte
        raise CalculatorError(f"not an arithmetic expression: {getattr(e, 'msg', None) or e}") from None
    value = _value(tree.body, source)
    return str(value.numerator) if value.denominator == 1 else f"{value.numerator}/{value.denominator}"


def calculator(expression: str) -> str:
    """Evaluate integer arithmetic exactly.

    Args:
        expression: integers combined with + - * / // and parentheses, e.g. "1234*567".
    """
    return calculate(expression)
