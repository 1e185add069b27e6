"""Experience operators: a chain the trainer applies to each group as it takes it from the feed (`trainer.operators`).

A spec is a registered name or `package.module:factory`, alone or as a mapping with arguments (`{name:
length_penalty, start: 48, end: 64}`). Operators run in order on rank 0's feed, after its own checks (decoding,
foreign run, duplicate group id, staleness): `apply(group)` returns the group, a changed copy (reward shaping), or
None to drop it. A dropped group is consumed for good (its offset and the operators' state are in the feed's
checkpoint; operators are deterministic functions of the groups seen), so a resumed trainer decides the same.
Drops are counted per step as `dropped/<reason>` (0 included). Shaped rewards are what the algorithm trains on and
`reward_mean` reports; each shaping adds a reward component (`length_penalty`, `format_bonus`).

Built-ins: `zero_variance(eps=1e-6)` drops a group whose rewards' std <= eps; `length_penalty(start, end,
penalty=1.0)`: reward -= penalty x clip((response tokens - start) / (end - start), 0, 1); `format_bonus(pattern,
bonus=0.1)`: reward += bonus where the decoded response matches `pattern`; `response_length(min_tokens=0,
max_tokens=null, max_fraction=0.0)` and `repetition(n=4, max_ratio=0.5, max_fraction=0.0)` drop a group when more
than `max_fraction` of its responses are out of length bounds / above the n-gram repetition ratio; `dedup()` drops
a group id seen before, including ones later operators dropped (put it first).

Factory contract: `factory(context: OperatorContext, **args)` returns an object with `reason` (drops' metric name,
None: never drops), `apply(group) -> ExperienceGroup | None`, optionally `state()` / `load_state(dict)` (JSON).
"""
from __future__ import annotations

import dataclasses
import difflib
import inspect
import math
import re
from collections.abc import Callable
from typing import Any, Protocol, TypeGuard

import numpy as np

from rft.registry import Registry
from rft.schema import ExperienceGroup, Sample
from rft.text.tokens import Detokenizer

DROP_PREFIX = "dropped/"


class OperatorError(ValueError):
    """An operator spec that cannot be built; the message names the key (`trainer.operators[i]...`)."""


class ArgumentError(OperatorError):
    """A bad argument of an operator: `key` names the argument."""

    def __init__(self, key: str, message: str):
        super().__init__(message)
        self.key = key


class Operator(Protocol):
    @property
    def reason(self) -> str | None: ...  # the metric name of its drops; None: it never drops

    def apply(self, group: ExperienceGroup) -> ExperienceGroup | None: ...


class StatefulOperator(Operator, Protocol):
    """An operator whose state a checkpoint keeps (JSON)."""

    def state(self) -> dict[str, Any]: ...

    def load_state(self, state: dict[str, Any]) -> None: ...


def is_stateful(op: Operator) -> TypeGuard[StatefulOperator]:
    return callable(getattr(op, "state", None))


class OperatorContext:
    """What operators may need from the run: the response text (through the model's tokenizer, loaded on first use)."""

    def __init__(self, tokenizer_path: str = ""):
        self.tokenizer_path = tokenizer_path
        self._detokenizer: Detokenizer | None = None

    def text(self, tokens: np.ndarray) -> str:
        if self._detokenizer is None:
            if not self.tokenizer_path:
                raise OperatorError("this operator needs the response text, and no tokenizer is configured")
            self._detokenizer = Detokenizer(self.tokenizer_path, skip_special_tokens=True)
        text = self._detokenizer.text(tokens)
        assert text is not None  # a Detokenizer with a path always decodes
        return text


OPERATORS: Registry[Callable[..., Operator]] = Registry("operator", error=OperatorError)
register_operator = OPERATORS.register  # @register_operator(name): `trainer.operators: [<name>]`


# --------------------------------------------------------------------------------------------------
# The chain


class OperatorChain:
    def __init__(self, names: list[str], operators: list[Operator]):
        self.names, self.operators = names, operators

    @property
    def reasons(self) -> list[str]:
        """The metric names of the drops this chain can make (`dropped/<reason>`), in chain order."""
        return list(dict.fromkeys(DROP_PREFIX + op.reason for op in self.operators if op.reason))

    def apply(self, group: ExperienceGroup) -> tuple[ExperienceGroup, str | None]:
        """The group after every operator, and None; or the input group and the reason of the first drop."""
        out = group
        for op in self.operators:
            applied = op.apply(out)
            if applied is None:
                return group, DROP_PREFIX + (op.reason or "unnamed")
            out = applied
        return out, None

    def _stateful(self) -> dict[str, StatefulOperator]:
        return {f"{i}:{name}": op for i, (name, op) in enumerate(zip(self.names, self.operators, strict=True))
                if is_stateful(op)}

    def state(self) -> dict[str, Any]:
        """The stateful operators' states, keyed by position and name (a changed chain starts them afresh)."""
        return {key: op.state() for key, op in self._stateful().items()}

    def load_state(self, state: dict[str, Any]) -> None:
        for key, op in self._stateful().items():
            if key in state:
                op.load_state(state[key])


def build_operator_chain(specs: list[Any], context: OperatorContext | None = None) -> OperatorChain | None:
    """The chain of `trainer.operators` (None when empty); OperatorError naming the key for a bad spec."""
    context = context or OperatorContext()
    names, operators = [], []
    for i, spec in enumerate(specs):
        where = f"trainer.operators[{i}]"
        name, args = _parse_spec(spec, where)
        factory = OPERATORS.resolve(name, key=f"{where}.name" if isinstance(spec, dict) else where)
        _check_arguments(factory, name, args, context, where)
        try:
            op = factory(context, **args)
        except ArgumentError as e:
            raise OperatorError(f"{where}.{e.key}: {e}") from None
        if not callable(getattr(op, "apply", None)) or not hasattr(op, "reason"):
            raise OperatorError(f"{where}: {name!r} built a {type(op).__name__} without `reason` and `apply(group)`")
        names.append(name)
        operators.append(op)
    return OperatorChain(names, operators) if operators else None


def check_operator_specs(specs: list[Any]) -> None:
    """Build the chain once without loading anything (a typo fails when the config loads)."""
    build_operator_chain(specs)


def _check_arguments(factory: Callable[..., Any], name: str, args: dict[str, Any], context: OperatorContext,
                     where: str) -> None:
    try:
        signature = inspect.signature(factory)
    except ValueError:
        return  # no signature to check (a builtin): the call says what is wrong
    params = signature.parameters
    if not any(p.kind is p.VAR_KEYWORD for p in params.values()):
        known = list(params)[1:]
        for key in args:
            if key not in known:
                near = difflib.get_close_matches(key, known, n=1)
                hint = f"did you mean {near[0]!r}? " if near else ""
                raise OperatorError(f"{where}.{key}: unknown argument of operator {name!r} ({hint}arguments: "
                                    f"{', '.join(known) or 'none'})")
    try:
        signature.bind(context, **args)
    except TypeError as e:
        raise OperatorError(f"{where}: operator {name!r}: {e}") from None


def _parse_spec(spec: Any, where: str) -> tuple[str, dict[str, Any]]:
    if isinstance(spec, str):
        return spec, {}
    if isinstance(spec, dict):
        if not isinstance(spec.get("name"), str):
            raise OperatorError(f"{where}.name: required: the operator's name or import path")
        return spec["name"], {str(k): v for k, v in spec.items() if k != "name"}
    raise OperatorError(f"{where}: expected an operator name or a mapping with `name`, got {type(spec).__name__}")


def split_drops(skipped: dict[str, int], chain: OperatorChain | None) -> tuple[dict[str, int], dict[str, int]]:
    """A step's skip counts split into (other skips, `dropped/<reason>` counts with every reason of the chain)."""
    drops = dict.fromkeys(chain.reasons if chain else [], 0)
    drops.update({k: v for k, v in skipped.items() if k.startswith(DROP_PREFIX)})
    return {k: v for k, v in skipped.items() if not k.startswith(DROP_PREFIX)}, drops


# --------------------------------------------------------------------------------------------------
# Argument checks and shared pieces


def _number(key: str, value: Any, *, minimum: float | None = None, integer: bool = False) -> Any:
    kinds = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds) or not math.isfinite(value):
        raise ArgumentError(key, f"expected {'an integer' if integer else 'a number'}, got {value!r}")
    if minimum is not None and value < minimum:
        raise ArgumentError(key, f"must be >= {minimum}, got {value}")
    return value


def _fraction(key: str, value: Any) -> float:
    value = _number(key, value, minimum=0)
    if value >= 1:
        raise ArgumentError(key, f"must be in [0, 1), got {value}")
    return float(value)


def _shaped(group: ExperienceGroup, amounts: list[float], component: str) -> ExperienceGroup:
    """A copy of `group` with `amounts[i]` added to sample i's reward and recorded as a reward component."""
    samples = [dataclasses.replace(s, reward=float(s.reward + a),
                                   reward_components={**s.reward_components, component: float(a)})
               for s, a in zip(group.samples, amounts, strict=True)]
    return dataclasses.replace(group, samples=samples)


def _unless_too_many(group: ExperienceGroup, fails: Callable[[Sample], bool],
                     max_fraction: float) -> ExperienceGroup | None:
    """None (drop) when more than `max_fraction` of the group's samples fail."""
    failing = sum(1 for s in group.samples if fails(s))
    return None if failing > max_fraction * len(group.samples) else group


def ngram_repetition(tokens: Any, n: int) -> float:
    """1 - distinct n-grams / n-grams of a token sequence: 0 without a repeated n-gram, toward 1 for a loop
    (0 for a sequence shorter than n)."""
    tokens = [int(t) for t in tokens]
    grams = [tuple(tokens[i:i + n]) for i in range(len(tokens) - n + 1)]
    return 1.0 - len(set(grams)) / len(grams) if grams else 0.0


# --------------------------------------------------------------------------------------------------
# Built-in operators


@register_operator("zero_variance")
class ZeroVariance:
    reason = "zero_variance"

    def __init__(self, context: OperatorContext, eps: float = 1e-6):
        self.eps = _number("eps", eps, minimum=0)

    def apply(self, group: ExperienceGroup) -> ExperienceGroup | None:
        return None if float(np.std(group.rewards)) <= self.eps else group


@register_operator("length_penalty")
class LengthPenalty:
    reason = None

    def __init__(self, context: OperatorContext, start: int, end: int, penalty: float = 1.0):
        self.start = _number("start", start, minimum=0, integer=True)
        self.end = _number("end", end, integer=True)
        if self.end <= self.start:
            raise ArgumentError("end", f"must be > start ({start}), got {end}")
        self.penalty = _number("penalty", penalty)

    def apply(self, group: ExperienceGroup) -> ExperienceGroup:
        span = self.end - self.start
        return _shaped(group, [-self.penalty * min(1.0, max(0.0, (len(s.response_tokens) - self.start) / span))
                               for s in group.samples], "length_penalty")


@register_operator("format_bonus")
class FormatBonus:
    reason = None

    def __init__(self, context: OperatorContext, pattern: str, bonus: float = 0.1):
        if not isinstance(pattern, str) or not pattern:
            raise ArgumentError("pattern", f"expected a non-empty regular expression, got {pattern!r}")
        try:
            self.pattern = re.compile(pattern)
        except re.error as e:
            raise ArgumentError("pattern", f"not a regular expression: {e}") from None
        self.bonus = float(_number("bonus", bonus))
        self.context = context

    def apply(self, group: ExperienceGroup) -> ExperienceGroup:
        texts = [self.context.text(s.response_tokens) for s in group.samples]
        return _shaped(group, [self.bonus if self.pattern.search(t) else 0.0 for t in texts], "format_bonus")


@register_operator("response_length")
class ResponseLength:
    reason = "response_length"

    def __init__(self, context: OperatorContext, min_tokens: int = 0, max_tokens: int | None = None,
                 max_fraction: float = 0.0):
        self.min_tokens = _number("min_tokens", min_tokens, minimum=0, integer=True)
        self.max_tokens = None if max_tokens is None else _number("max_tokens", max_tokens, minimum=min_tokens,
                                                                  integer=True)
        self.max_fraction = _fraction("max_fraction", max_fraction)

    def apply(self, group: ExperienceGroup) -> ExperienceGroup | None:
        def outside(s: Sample) -> bool:
            n = len(s.response_tokens)
            return n < self.min_tokens or (self.max_tokens is not None and n > self.max_tokens)
        return _unless_too_many(group, outside, self.max_fraction)


@register_operator("repetition")
class Repetition:
    reason = "repetition"

    def __init__(self, context: OperatorContext, n: int = 4, max_ratio: float = 0.5, max_fraction: float = 0.0):
        self.n = _number("n", n, minimum=1, integer=True)
        self.max_ratio = _fraction("max_ratio", max_ratio)
        self.max_fraction = _fraction("max_fraction", max_fraction)

    def apply(self, group: ExperienceGroup) -> ExperienceGroup | None:
        return _unless_too_many(group, lambda s: ngram_repetition(s.response_tokens, self.n) > self.max_ratio,
                                self.max_fraction)


@register_operator("dedup")
class Dedup:
    reason = "dedup"

    def __init__(self, context: OperatorContext):
        self._seen: dict[str, None] = {}  # insertion-ordered, so the saved state is stable

    def apply(self, group: ExperienceGroup) -> ExperienceGroup | None:
        if group.group_id in self._seen:
            return None
        self._seen[group.group_id] = None
        return group

    def state(self) -> dict[str, Any]:
        return {"seen": list(self._seen)}

    def load_state(self, state: dict[str, Any]) -> None:
        self._seen = dict.fromkeys(str(g) for g in state.get("seen", []))
