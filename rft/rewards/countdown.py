"""Countdown: reach a target number with an arithmetic expression using each given number exactly once.

Task shape (TinyZero's): the ground truth is `{"target": int, "numbers": [int, ...]}`, or the target
alone with the numbers in `task.metadata["numbers"]` (or `"nums"`, the dataset's column name).
The equation is the content of the last `<answer>...</answer>` block, else the response's last
non-empty line; a trailing `= target` is allowed. Only + - * / and parentheses are evaluated, through
the `ast` module (never `eval`).
"""
from __future__ import annotations

import ast
import operator
import re
from collections import Counter
from typing import Any

from rft.rewards.registry import RewardResult, register_reward
from rft.rewards.text import answer_tag_content
from rft.schema import TaskRecord

FORMAT_SCORE = 0.1  # a well-formed equation over exactly the given numbers, with the wrong value
_ALLOWED_CHARS = re.compile(r"[0-9+\-*/().\s]+")
_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


def _target_and_numbers(task: TaskRecord) -> tuple[float, list[int]] | None:
    answer: Any = task.answer
    target: Any  # JSON values from the record, checked by the conversions below
    numbers: Any
    if isinstance(answer, dict):
        target, numbers = answer.get("target"), answer.get("numbers", answer.get("nums"))
    else:
        target, numbers = answer, task.metadata.get("numbers", task.metadata.get("nums"))
    try:
        return float(target), [int(n) for n in numbers]
    except (TypeError, ValueError):
        return None


def _equation(response: str) -> str:
    text = answer_tag_content(response)
    if text is None:
        lines = [line for line in response.splitlines() if line.strip()]
        text = lines[-1] if lines else ""
    return text.split("=")[0].strip()


def _evaluate(node: ast.AST) -> float:
    if isinstance(node, ast.Expression):
        return _evaluate(node.body)
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        return _OPERATORS[type(node.op)](_evaluate(node.left), _evaluate(node.right))
    raise ValueError(f"not allowed in an equation: {type(node).__name__}")


@register_reward("countdown")
def countdown(response: str, task: TaskRecord) -> RewardResult:
    """1 if the equation uses each given number exactly once and equals the target (within 1e-6);
    0.1 if it is well formed and uses the numbers but misses the target; else 0.
    Components: `well_formed`, `uses_numbers`, `correct`."""
    spec = _target_and_numbers(task)
    equation = _equation(response)
    zero = RewardResult(0.0, {"well_formed": 0.0, "uses_numbers": 0.0, "correct": 0.0})
    if spec is None or not equation or not _ALLOWED_CHARS.fullmatch(equation):
        return zero
    target, numbers = spec
    try:
        value = _evaluate(ast.parse(equation, mode="eval"))
    except (SyntaxError, ValueError, ZeroDivisionError, OverflowError, RecursionError):
        return zero
    used = Counter(int(n) for n in re.findall(r"\d+", equation))
    uses_numbers = used == Counter(numbers)
    correct = uses_numbers and abs(value - target) < 1e-6
    score = 1.0 if correct else FORMAT_SCORE if uses_numbers else 0.0
    return RewardResult(score, {"well_formed": 1.0, "uses_numbers": float(uses_numbers), "correct": float(correct)})
