"""`calculator`: an arithmetic expression evaluated by walking its `ast` (never `eval`).

Accepted: int and float literals, `+ - * / // % **`, unary `+ -` and parentheses; Python's own semantics
(`7 / 2` is 3.5, `7 // 2` is 3, `-7 % 3` is 2). The answer is `str(value)`. Refused with a ToolError: anything
else (names, calls, attributes, strings, comparisons), expressions over 200 characters, exponents above 1000
in absolute value or powers whose result would have over 4000 digits (no `9**9**9`), division by zero.
"""
from __future__ import annotations

import ast
import math
import operator
from collections.abc import Callable
from typing import Any

from rft.agent_tools.registry import ToolError, ToolLimits, function_schema, register_tool, require_arguments

MAX_CHARS = 200
MAX_EXPONENT = 1000
MAX_DIGITS = 4000

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY: dict[type[ast.unaryop], Callable[[Any], Any]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}


def evaluate(expression: str) -> int | float:
    """The value of an arithmetic expression; ToolError saying what is not allowed."""
    if len(expression) > MAX_CHARS:
        raise ToolError(f"calculator: expression is {len(expression)} characters, over {MAX_CHARS}")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as e:
        raise ToolError(f"calculator: not an arithmetic expression: {e.msg}") from None
    return _value(tree.body)


def _value(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_value(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _value(node.left), _value(node.right)
        if isinstance(node.op, ast.Pow):
            _check_power(left, right)
        try:
            return _BINARY[type(node.op)](left, right)
        except ZeroDivisionError:
            raise ToolError("calculator: division by zero") from None
        except OverflowError:
            raise ToolError("calculator: result too large") from None
    raise ToolError(f"calculator: {type(node).__name__} is not allowed (numbers and + - * / // % ** only)")


def _check_power(base: int | float, exponent: int | float) -> None:
    if abs(exponent) > MAX_EXPONENT:
        raise ToolError(f"calculator: exponent {exponent} is over {MAX_EXPONENT} in absolute value")
    if isinstance(base, int) and isinstance(exponent, int) and abs(base) > 1 and exponent > 0:
        if exponent * math.log10(abs(base)) > MAX_DIGITS:
            raise ToolError(f"calculator: result would have over {MAX_DIGITS} digits")


@register_tool("calculator")
class Calculator:
    schema = function_schema("calculator", "Evaluate an arithmetic expression (numbers, + - * / // % ** and "
                             "parentheses) and return its value.", expression="the expression, e.g. (3 + 4) * 12")

    def __init__(self, limits: ToolLimits):
        self.limits = limits

    def __call__(self, arguments: dict[str, Any]) -> str:
        (expression,) = require_arguments(arguments, "calculator", expression=str)
        return str(evaluate(expression))
