"""Rewards: score a group of responses to one task (the contract is in `rft.rewards.registry`).

Rewards are chosen by name from the registry (`explorer.reward`), or by import path `package.module:function`
as an escape hatch. Names are resolved when a config is loaded for a run (`rft.run.loading` calls
`check_reward_config`), so a misspelt reward fails before any process starts.

- Per-response rewards are plain functions `fn(response: str, task: TaskRecord) -> RewardResult | float`
  registered with `@register_reward("name")`. An import path may name such a function.
- Stateful rewards (a judge model) are classes with `from_config(explorer: ExplorerConfig, context: RewardContext)
  -> Reward`, registered with `register_reward_factory("name", cls)`. An import path may name such a class.
- Per-response functions run in reward worker processes under `explorer.reward_timeout_s` when the reward is built
  with workers (`RewardContext.workers`: every run's explorer and evaluator; rft/rewards/limits.py): a hung verifier
  is a `timeout` failure, not a stall; one that raises is a `verifier` failure, one that returns None `unscored`.
- `explorer.reward: weighted` combines the rewards named in `explorer.reward_weights` into the
  weighted mean sum_i w_i r_i / sum_i w_i (weights >= 0, not all 0), so the result stays in [0, 1].
- A factory may define `check_config(explorer)`: `check_reward_config` calls it for every reward a config names,
  so its keys (a judge model, a template, a verifier) fail when the config loads, naming the key.

Importing this package registers the built-in rewards (text, math_answer, countdown, reasoning_gym, and the judge
rewards judge, rubric, ruler; rlcr).
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from rft.rewards import countdown, judge, math_answer, reasoning_gym, rlcr, rubric, ruler, text  # noqa: F401  (registers the built-ins)
from rft.rewards.context import RewardContext
from rft.rewards.limits import RewardWorkers, score_in_process
from rft.rewards.registry import (
    REWARDS,
    Reward,
    RewardError,
    RewardFn,
    RewardResult,
    checked,
    is_factory,
    register_reward,
    register_reward_factory,
)

if TYPE_CHECKING:
    from rft.explorer.config import ExplorerConfig
    from rft.schema import TaskRecord

__all__ = ["REWARDS", "WEIGHTED", "FunctionReward", "Reward", "RewardContext", "RewardError", "RewardFn",
           "RewardResult", "RewardWorkers", "WeightedReward", "available_rewards", "build_reward",
           "check_reward_config", "checked", "register_reward", "register_reward_factory", "resolve"]

WEIGHTED = "weighted"


def available_rewards() -> list[str]:
    return sorted(REWARDS)


class FunctionReward:
    """Adapts a per-response function to `Reward`, checking every score it returns; with `workers`, each call runs in
    a worker process under their time limit (rft/rewards/limits.py), else in this process (failures marked alike,
    without a limit)."""

    def __init__(self, name: str, fn: RewardFn, workers: RewardWorkers | None = None):
        self.name, self.fn, self.workers = name, fn, workers

    def score(self, responses: Sequence[str], task: TaskRecord) -> list[RewardResult]:
        if self.workers is not None:
            return self.workers.score(self.name, responses, task)
        return [score_in_process(self.name, self.fn, response, task) for response in responses]


class WeightedReward:
    """sum_i w_i r_i / sum_i w_i; components: each part's score under its name, and its own components
    as `name.component`."""

    def __init__(self, parts: dict[str, Reward], weights: dict[str, float]):
        self.parts, self.weights = parts, weights
        self.total = sum(weights.values())

    @classmethod
    def from_config(cls, explorer: ExplorerConfig, context: RewardContext | None) -> WeightedReward:
        parts = {name: _build_one(name, explorer, context) for name in explorer.reward_weights}
        return cls(parts, dict(explorer.reward_weights))

    def score(self, responses: Sequence[str], task: TaskRecord) -> list[RewardResult]:
        per_part = {name: part.score(responses, task) for name, part in self.parts.items()}
        out = []
        for i in range(len(responses)):
            components: dict[str, float] = {}
            total = 0.0
            failed = next((results[i].failure for results in per_part.values() if results[i].failure), "")
            if failed:  # a part could not score the response: neither can the whole
                out.append(RewardResult(0.0, {}, failure=failed))
                continue
            for name, results in per_part.items():
                total += self.weights[name] * results[i].score
                components[name] = results[i].score
                components.update({f"{name}.{k}": v for k, v in results[i].components.items()})
            out.append(checked(WEIGHTED, RewardResult(total / self.total, components)))
        return out


register_reward_factory(WEIGHTED, WeightedReward)


# --------------------------------------------------------------------------------------------------
# Resolution (names and import paths) and building.


def resolve(spec: str, *, key: str = "explorer.reward") -> tuple[str, Any]:
    """Look up a reward by registry name or `pkg.mod:attr`; returns ("function" | "factory", object).
    Raises RewardError naming `key`, the spec and the close matches."""
    obj = REWARDS.resolve(spec, key=key)
    return ("factory", obj) if is_factory(obj) else ("function", obj)


def check_reward_config(explorer: ExplorerConfig) -> None:
    """Resolve `explorer.reward` and `explorer.reward_weights` without building anything.
    Raises RewardError whose message starts with the offending dotted key."""
    weights = explorer.reward_weights
    if explorer.reward == WEIGHTED:
        if not weights:
            raise RewardError("explorer.reward_weights: reward 'weighted' needs at least one reward: weight entry")
        for name, w in weights.items():
            if not (math.isfinite(w) and w >= 0):
                raise RewardError(f"explorer.reward_weights.{name}: weight must be >= 0, got {w}")
            if name == WEIGHTED:
                raise RewardError("explorer.reward_weights.weighted: a weighted reward cannot contain itself")
            _check_own_keys(resolve(name, key=f"explorer.reward_weights.{name}"), explorer)
        if sum(weights.values()) <= 0:
            raise RewardError("explorer.reward_weights: weights must not all be 0")
        return
    if weights:
        raise RewardError(f"explorer.reward_weights: set explorer.reward to 'weighted' to combine rewards "
                          f"(it is {explorer.reward!r})")
    _check_own_keys(resolve(explorer.reward, key="explorer.reward"), explorer)


def _check_own_keys(resolved: tuple[str, Any], explorer: ExplorerConfig) -> None:
    """A factory's `check_config(explorer)`, if it has one."""
    kind, obj = resolved
    check = getattr(obj, "check_config", None) if kind == "factory" else None
    if callable(check):
        check(explorer)


def build_reward(explorer: ExplorerConfig, context: RewardContext | None = None) -> Reward:
    """The `Reward` that `explorer.reward` names (stateful ones, e.g. a judge, start their engines here through
    `context`, which only they need)."""
    check_reward_config(explorer)
    return _build_one(explorer.reward, explorer, context)


def _build_one(spec: str, explorer: ExplorerConfig, context: RewardContext | None) -> Reward:
    kind, obj = resolve(spec)
    if kind == "factory":
        return obj.from_config(explorer, context)
    return FunctionReward(spec, obj, context.workers if context is not None else None)
