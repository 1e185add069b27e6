"""String rewards: exact match, the think/answer format, and the dense toy-task reward.

All scores are in [0, 1]; any string (empty, binary junk, unterminated tags) is a valid input.
"""
from __future__ import annotations

import re

from rft.rewards.registry import RewardResult, register_reward
from rft.schema import TaskRecord

_THINK_ANSWER = re.compile(r"\s*<think>.*?</think>\s*<answer>(.*?)</answer>\s*", re.DOTALL)
_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_NUMBER = re.compile(r"-?\d+(?:,\d{3})*(?:\.\d+)?")


@register_reward("exact_match")
def exact_match(response: str, task: TaskRecord) -> RewardResult:
    """1 if the response, stripped of surrounding whitespace, equals str(answer) stripped; else 0."""
    if task.answer is None:
        return RewardResult(0.0, {"has_answer": 0.0})
    return RewardResult(float(response.strip() == str(task.answer).strip()), {"has_answer": 1.0})


@register_reward("format")
def think_answer_format(response: str, task: TaskRecord) -> RewardResult:
    """1 if the whole response is `<think>...</think><answer>...</answer>` (whitespace allowed around
    them), else 0. Components say which tags were present at all."""
    whole = _THINK_ANSWER.fullmatch(response) is not None
    return RewardResult(float(whole), {
        "has_think": float("<think>" in response and "</think>" in response),
        "has_answer": float(_ANSWER_TAG.search(response) is not None),
    })


def last_number(response: str) -> str | None:
    """The last number written in the response (an optional minus sign directly before the digits, thousands
    separators dropped, a decimal part kept as written: "= -1,234.50." -> "-1234.50"), or None when there is none."""
    found = _NUMBER.findall(response)
    return found[-1].replace(",", "") if found else None


def answer_tag_content(response: str) -> str | None:
    """The text of the last `<answer>...</answer>` block, or None when there is none."""
    found = _ANSWER_TAG.findall(response)
    return found[-1].strip() if found else None


# The toy reward's weights: most of the credit for the right characters in the right places, some
# for staying inside the task's alphabet, which a random policy hits often enough to learn from.
POSITION_WEIGHT = 0.75
ALPHABET_WEIGHT = 0.25


@register_reward("char_accuracy")
def char_accuracy(response: str, task: TaskRecord) -> RewardResult:
    """Dense partial credit for toy copy tasks (a tiny model learns it from random init with RL).

    position = #(i: response[i] == answer[i]) / max(len(response), len(answer))  (extra or missing
    characters count as wrong); alphabet = fraction of response characters in the task's alphabet
    (`task.metadata["alphabet"]`, default: the answer's own characters; 0 for an empty response).
    score = 0.75 * position + 0.25 * alphabet. Trailing whitespace of the response is ignored.
    """
    answer = "" if task.answer is None else str(task.answer)
    text = response.rstrip()
    longest = max(len(text), len(answer))
    position = sum(a == b for a, b in zip(text, answer, strict=False)) / longest if longest else 1.0
    alphabet = set(task.metadata.get("alphabet") or answer)
    in_alphabet = sum(c in alphabet for c in text) / len(text) if text else 0.0
    return RewardResult(POSITION_WEIGHT * position + ALPHABET_WEIGHT * in_alphabet,
                        {"position": position, "alphabet": in_alphabet})
