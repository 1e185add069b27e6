"""The reward registry and the contract every reward meets; the built-in reward modules register into it.

Contract of every reward: `score(responses, task) -> list[RewardResult]`, one result per response, in order. A
result's `score` is a float in [0, 1] (1 = fully right); `components` are named sub-scores (also floats) that the
explorer records beside it for diagnostics. A reward never raises on what a model wrote: malformed output scores 0.
A reward that returns a score outside [0, 1] (or NaN) is a bug in the reward and raises `RewardError` naming it.
A reward that returns None could not score the response (`unscored`); one that raises (anything but a `TaskError`)
crashed (`verifier`), and one past `explorer.reward_timeout_s` timed out (`timeout`): the sample is a failed rollout
(`RewardResult.failure`, docs/schema.md "Failed rollouts"), left out of its group's baseline, never a 0.

`REWARDS` maps a name to either a per-response function `fn(response, task) -> RewardResult | float`
(`@register_reward(name)`) or a factory, a class with `from_config(explorer, context) -> Reward`
(`register_reward_factory(name, cls)`); `is_factory` tells them apart. This module imports no reward.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from rft.registry import Registry
from rft.schema import FAILURE_CLASSES

if TYPE_CHECKING:
    from rft.schema import TaskRecord


class RewardError(ValueError):
    """A reward that cannot be built or that returned an invalid score."""


class TaskError(ValueError):
    """A task record that a reward cannot score: a field it needs is missing or invalid (a record read from a topic
    is not trusted beyond its schema). Workflows turn it into the group's `error`, so the explorer sends the task
    to the dead-letter topic and goes on; unlike RewardError it is not a bug in the reward."""


@dataclass(frozen=True)
class RewardResult:
    """One response's reward: `score` in [0, 1] plus named sub-scores; `failure` (rft.schema.FAILURE_CLASSES) when
    the response could not be scored (`score` then means nothing): the sample is a failed rollout."""
    score: float
    components: dict[str, float] = field(default_factory=dict)
    failure: str = ""


class Reward(Protocol):
    """Scores all responses to one task at once (batching lets a judge model score a group in one call)."""

    def score(self, responses: Sequence[str], task: TaskRecord) -> list[RewardResult]: ...


RewardFn = Callable[[str, "TaskRecord"], "RewardResult | float | None"]

REWARDS: Registry[Any] = Registry("reward", noun="reward", error=RewardError)


def register_reward(name: str) -> Callable[[RewardFn], RewardFn]:
    """Decorator registering a per-response reward function under `name`."""
    return REWARDS.register(name)


def register_reward_factory(name: str, factory: Any) -> None:
    """Register a stateful reward: `factory.from_config(explorer, context)` returns a `Reward`."""
    REWARDS.add(name, factory)


def is_factory(obj: Any) -> bool:
    """A registered or imported reward is a factory (has `from_config`), else a per-response function."""
    return hasattr(obj, "from_config")


def checked(name: str, result: RewardResult | float | None) -> RewardResult:
    """Normalise a reward's return value and enforce the [0, 1] contract (None: `unscored`)."""
    if result is None:
        return RewardResult(0.0, failure="unscored")
    if isinstance(result, RewardResult) and result.failure:
        if result.failure not in FAILURE_CLASSES:
            raise RewardError(f"reward {name!r} returned failure {result.failure!r}, not one of {FAILURE_CLASSES}")
        return RewardResult(0.0, {k: float(v) for k, v in result.components.items()}, failure=result.failure)
    if not isinstance(result, RewardResult):
        if isinstance(result, bool) or not isinstance(result, (int, float)):
            raise RewardError(f"reward {name!r} returned {type(result).__name__}; expected a float or RewardResult")
        result = RewardResult(float(result))
    score = result.score
    if not (isinstance(score, (int, float)) and math.isfinite(score) and 0.0 <= score <= 1.0):
        raise RewardError(f"reward {name!r} returned score {score!r}; rewards must be in [0, 1]")
    return RewardResult(float(score), {k: float(v) for k, v in result.components.items()})
