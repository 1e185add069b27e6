"""Rewards: score a group of responses to one task.

Contract of every reward: `score(responses, task) -> list[RewardResult]`, one result per response, in
order. A result's `score` is a float in [0, 1] (1 = fully right); `components` are named sub-scores
(also floats) that the explorer records beside it for diagnostics. A reward never raises on what a
model wrote: malformed output scores 0. A reward that returns a score outside [0, 1] (or NaN) is a
bug in the reward and raises `RewardError` naming it.

Rewards are chosen by name from the registry (`explorer.reward`), or by import path
`package.module:function` as an escape hatch. Both are resolved when the config loads (see
`check_reward_config`), so a misspelt reward fails before any process starts.

- Per-response rewards are plain functions `fn(response: str, task: TaskRecord) -> RewardResult | float`
  registered with `@register_reward("name")`. An import path may name such a function.
- Stateful rewards (a judge model) are classes with `from_config(cfg: Config) -> Reward`, registered
  with `register_reward_factory("name", cls)`. An import path may name such a class.
- `explorer.reward: weighted` combines the rewards named in `explorer.reward_weights` into the
  weighted mean sum_i w_i r_i / sum_i w_i (weights >= 0, not all 0), so the result stays in [0, 1].
"""
from __future__ import annotations

import difflib
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Protocol, Sequence

from rft.imports import import_object as _import_object

if TYPE_CHECKING:
    from rft.config import Config, ExplorerConfig
    from rft.schema import TaskRecord


class RewardError(ValueError):
    """A reward that cannot be built or that returned an invalid score."""


@dataclass(frozen=True)
class RewardResult:
    """One response's reward: `score` in [0, 1] plus named sub-scores."""
    score: float
    components: dict[str, float] = field(default_factory=dict)


class Reward(Protocol):
    """Scores all responses to one task at once (batching lets a judge model score a group in one call)."""

    def score(self, responses: Sequence[str], task: "TaskRecord") -> list[RewardResult]: ...


RewardFn = Callable[[str, "TaskRecord"], "RewardResult | float"]

WEIGHTED = "weighted"
_FUNCTIONS: dict[str, RewardFn] = {}
_FACTORIES: dict[str, Any] = {}  # name -> class with from_config(cfg) -> Reward


def register_reward(name: str) -> Callable[[RewardFn], RewardFn]:
    """Decorator registering a per-response reward function under `name`."""
    def decorate(fn: RewardFn) -> RewardFn:
        _claim(name)
        _FUNCTIONS[name] = fn
        return fn
    return decorate


def register_reward_factory(name: str, factory: Any) -> None:
    """Register a stateful reward: `factory.from_config(cfg)` returns a `Reward`."""
    _claim(name)
    _FACTORIES[name] = factory


def _claim(name: str) -> None:
    if name in _FUNCTIONS or name in _FACTORIES or name == WEIGHTED:
        raise RewardError(f"reward {name!r} is already registered")


def available_rewards() -> list[str]:
    _load_builtins()
    return sorted([*_FUNCTIONS, *_FACTORIES, WEIGHTED])


class FunctionReward:
    """Adapts a per-response function to `Reward`, checking every score it returns."""

    def __init__(self, name: str, fn: RewardFn):
        self.name, self.fn = name, fn

    def score(self, responses: Sequence[str], task: "TaskRecord") -> list[RewardResult]:
        return [checked(self.name, self.fn(response, task)) for response in responses]


class WeightedReward:
    """sum_i w_i r_i / sum_i w_i; components: each part's score under its name, and its own components
    as `name.component`."""

    def __init__(self, parts: dict[str, Reward], weights: dict[str, float]):
        self.parts, self.weights = parts, weights
        self.total = sum(weights.values())

    def score(self, responses: Sequence[str], task: "TaskRecord") -> list[RewardResult]:
        per_part = {name: part.score(responses, task) for name, part in self.parts.items()}
        out = []
        for i in range(len(responses)):
            components: dict[str, float] = {}
            total = 0.0
            for name, results in per_part.items():
                total += self.weights[name] * results[i].score
                components[name] = results[i].score
                components.update({f"{name}.{k}": v for k, v in results[i].components.items()})
            out.append(checked(WEIGHTED, RewardResult(total / self.total, components)))
        return out


def checked(name: str, result: RewardResult | float) -> RewardResult:
    """Normalise a reward's return value and enforce the [0, 1] contract."""
    if not isinstance(result, RewardResult):
        if isinstance(result, bool) or not isinstance(result, (int, float)):
            raise RewardError(f"reward {name!r} returned {type(result).__name__}; expected a float or RewardResult")
        result = RewardResult(float(result))
    score = result.score
    if not (isinstance(score, (int, float)) and math.isfinite(score) and 0.0 <= score <= 1.0):
        raise RewardError(f"reward {name!r} returned score {score!r}; rewards must be in [0, 1]")
    return RewardResult(float(score), {k: float(v) for k, v in result.components.items()})


# --------------------------------------------------------------------------------------------------
# Resolution (names and import paths) and building.


def resolve(spec: str) -> tuple[str, Any]:
    """Look up a reward by registry name or `pkg.mod:attr`; returns ("function" | "factory", object).
    Raises RewardError naming the spec and the close matches."""
    _load_builtins()
    if spec in _FUNCTIONS:
        return "function", _FUNCTIONS[spec]
    if spec in _FACTORIES:
        return "factory", _FACTORIES[spec]
    if ":" in spec:
        obj = import_object(spec, what="reward")
        return ("factory", obj) if hasattr(obj, "from_config") else ("function", obj)
    near = difflib.get_close_matches(spec, available_rewards(), n=1)
    hint = f" (did you mean '{near[0]}'?)" if near else ""
    raise RewardError(f"unknown reward {spec!r}{hint}; registered: {', '.join(available_rewards())}; "
                      "or give an import path package.module:function")


def import_object(spec: str, *, what: str) -> Any:
    """`rft.imports.import_object` raising RewardError (what the explorer config checks catch)."""
    return _import_object(spec, what=what, error=RewardError)


def check_reward_config(explorer: "ExplorerConfig") -> None:
    """Resolve `explorer.reward` and `explorer.reward_weights` without building anything.
    Raises RewardError whose message starts with the offending dotted key."""
    weights = explorer.reward_weights
    _check_judge(explorer)
    if explorer.reward == WEIGHTED:
        if not weights:
            raise RewardError("explorer.reward_weights: reward 'weighted' needs at least one reward: weight entry")
        for name, w in weights.items():
            if not (math.isfinite(w) and w >= 0):
                raise RewardError(f"explorer.reward_weights.{name}: weight must be >= 0, got {w}")
            if name == WEIGHTED:
                raise RewardError("explorer.reward_weights.weighted: a weighted reward cannot contain itself")
            _resolve_for(f"explorer.reward_weights.{name}", name)
        if sum(weights.values()) <= 0:
            raise RewardError("explorer.reward_weights: weights must not all be 0")
        return
    if weights:
        raise RewardError(f"explorer.reward_weights: set explorer.reward to 'weighted' to combine rewards "
                          f"(it is {explorer.reward!r})")
    _resolve_for("explorer.reward", explorer.reward)


def _check_judge(explorer: "ExplorerConfig") -> None:
    names = explorer.reward_weights if explorer.reward == WEIGHTED else [explorer.reward]
    if "judge" in names and not explorer.judge_model:
        raise RewardError("explorer.judge_model: the judge reward needs a judge model directory")


def _resolve_for(key: str, spec: str) -> None:
    try:
        resolve(spec)
    except RewardError as e:
        raise RewardError(f"{key}: {e}") from None


def build_reward(cfg: "Config") -> Reward:
    """The `Reward` the config names (stateful ones, e.g. a judge, start their engines here)."""
    explorer = cfg.explorer
    check_reward_config(explorer)
    if explorer.reward == WEIGHTED:
        parts = {name: _build_one(name, cfg) for name in explorer.reward_weights}
        return WeightedReward(parts, dict(explorer.reward_weights))
    return _build_one(explorer.reward, cfg)


def _build_one(spec: str, cfg: "Config") -> Reward:
    kind, obj = resolve(spec)
    return obj.from_config(cfg) if kind == "factory" else FunctionReward(spec, obj)


_BUILTINS_LOADED = False


def _load_builtins() -> None:
    """Import the built-in reward modules (they register themselves); deferred to avoid import cycles."""
    global _BUILTINS_LOADED
    if not _BUILTINS_LOADED:
        _BUILTINS_LOADED = True
        from rft.rewards import countdown, judge, math_answer, text  # noqa: F401
