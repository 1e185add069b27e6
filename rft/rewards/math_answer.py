"""Math answer checking with `math-verify`: the response's final answer against the ground truth.

`math-verify` extracts the answer (preferring `\\boxed{...}`, else the last expression) and compares
symbolically (1/2 == 0.5 == \\frac{1}{2}). Its own timeouts (`signal.alarm`, main thread only) are off: a run scores
it in a reward worker under `explorer.reward_timeout_s`, which kills a hung parse or comparison (a `timeout`
failure, rft/rewards/limits.py).
"""
from __future__ import annotations

from rft.rewards.registry import RewardResult, register_reward
from rft.rewards.text import answer_tag_content
from rft.schema import TaskRecord


def _parse(text: str) -> list:
    import math_verify
    try:
        return math_verify.parse(text, parsing_timeout=None)
    except Exception:  # math-verify raises assorted sympy/latex2sympy errors on junk input
        return []


def _gold_text(answer: object) -> str:
    """Ground truth as LaTeX-ish text math-verify can parse; GSM8K's '#### 72' keeps what follows ####."""
    text = str(answer).strip()
    if "####" in text:
        text = text.rsplit("####", 1)[1].strip()
    return text if text.startswith("$") or "\\boxed" in text else f"${text}$"


@register_reward("math")
def math_answer(response: str, task: TaskRecord) -> RewardResult:
    """1 if the response's final answer (inside <answer> tags when present) equals the ground truth
    mathematically, else 0. Components: `parsed` (an answer was found in the response), `correct`."""
    import math_verify
    if task.answer is None:
        return RewardResult(0.0, {"parsed": 0.0, "correct": 0.0})
    gold = _parse(_gold_text(task.answer))
    predicted = _parse(answer_tag_content(response) or response)
    if not gold or not predicted:
        return RewardResult(0.0, {"parsed": float(bool(predicted)), "correct": 0.0})
    try:
        correct = bool(math_verify.verify(gold, predicted, timeout_seconds=None))
    except Exception:
        correct = False
    return RewardResult(float(correct), {"parsed": 1.0, "correct": float(correct)})
