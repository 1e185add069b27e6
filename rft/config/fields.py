"""How a section declares its keys: `option(default, help=..., range=...)` puts a key's description and its range in
the field's metadata, the one place where that key is described (docs/config.md is generated from it).

Contract of `Section`: every section dataclass derives from it and is frozen (the checked config is the config that
runs; a derived value is a new object, `dataclasses.replace`). Constructing one checks each numeric field against its
`range`, then calls `validate()` of every class in its MRO that defines one (a section composed of its owners'
option classes runs each owner's checks). A check raises `SectionError(key, message)` with the key relative to the
section; it reads `<KEY>.<key>: <message>` (the class's `KEY`, e.g. `explorer`), and the loader (rft.config.loader)
names the file and the section's dotted path instead (`data.mix[2].weight`).
"""
from __future__ import annotations

import dataclasses
import math
import types
import typing
from dataclasses import dataclass
from typing import Any, ClassVar

from rft.config.errors import ConfigError

HELP, RANGE, REST, NOT_A_KEY = "help", "range", "rest", "not_a_key"


@dataclass(frozen=True)
class Range:
    """The interval a numeric key must lie in: [low, high], each end open when `low_open` / `high_open`; a None value
    (an optional key left null) always holds. `note` says what special values mean, e.g. "0: off"."""
    low: float = -math.inf
    high: float = math.inf
    low_open: bool = False
    high_open: bool = False
    note: str = ""

    def holds(self, value: float | None) -> bool:
        if value is None:
            return True
        if not math.isfinite(value):
            return False
        above = value > self.low if self.low_open else value >= self.low
        below = value < self.high if self.high_open else value <= self.high
        return above and below

    def __str__(self) -> str:
        if self.low == -math.inf and self.high == math.inf:
            text = "a finite number"
        elif self.high == math.inf:
            text = f"{'>' if self.low_open else '>='} {self.low:g}"
        elif self.low == -math.inf:
            text = f"{'<' if self.high_open else '<='} {self.high:g}"
        else:
            text = f"in {'(' if self.low_open else '['}{self.low:g}, {self.high:g}{')' if self.high_open else ']'}"
        return f"{text} ({self.note})" if self.note else text


def at_least(low: float, note: str = "") -> Range:
    return Range(low=low, note=note)


FINITE = Range()
POSITIVE = Range(low=0, low_open=True)  # > 0: durations, rates, sizes that cannot be zero
COUNT = at_least(1)  # a number of things that must be there
OPTIONAL = at_least(0, "0: off")  # a count or duration where 0 turns the feature off
SEED = at_least(0)
PROBABILITY = Range(0, 1)
PORT = Range(1, 65535)
PORT_OR_OFF = Range(0, 65535, note="0: off")
PORT_OR_ANY = Range(0, 65535, note="0: any free port")


def option(default: Any = dataclasses.MISSING, *, help: str, range: Range | None = None,
           factory: Any = dataclasses.MISSING) -> Any:
    """A config key: its default (or `factory` for a mutable one), its description and, for a number, its range."""
    metadata: dict[str, Any] = {HELP: help}
    if range is not None:
        metadata[RANGE] = range
    if factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=factory, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def section(cls: type) -> Any:
    """A nested section (e.g. `model.lora`), built with its own defaults."""
    return dataclasses.field(default_factory=cls)


def rest_field(cls: type) -> str | None:
    """The field marked `metadata={"rest": True}`: it holds the section's keys that are not fields (another module
    builds them, e.g. algorithm.options), and is not itself a key."""
    if not dataclasses.is_dataclass(cls):
        return None
    return next((f.name for f in dataclasses.fields(cls) if f.metadata.get(REST)), None)


def is_numeric(tp: Any) -> bool:
    """Whether the annotation `tp` is int or float, optionally with None."""
    union = typing.get_origin(tp) in (typing.Union, types.UnionType)
    inner = [a for a in typing.get_args(tp) if a is not type(None)] if union else [tp]
    return len(inner) == 1 and inner[0] in (int, float)


class SectionError(ConfigError):
    """A section's own check failed: `key` (relative to the section) and `message`; `section` the section's path."""

    def __init__(self, key: str, message: str, section: str = ""):
        self.key, self.message = key, message
        super().__init__(f"{section}.{key}: {message}" if section else f"{key}: {message}")


@dataclass(frozen=True)
class Section:
    """Base of every config section (see the module docstring)."""
    KEY: ClassVar[str] = ""  # the section's dotted path in a run's config, for errors of sections built by code

    def __post_init__(self) -> None:
        try:
            for f in dataclasses.fields(self):
                bounds = f.metadata.get(RANGE)
                value = getattr(self, f.name)
                if bounds is not None and isinstance(value, (int, float)) and not bounds.holds(value):
                    raise SectionError(f.name, f"must be {bounds}, got {value}")
            for cls in reversed(type(self).__mro__):
                check = cls.__dict__.get("validate")
                if check is not None:
                    check(self)
        except SectionError as e:
            raise SectionError(e.key, e.message, self.KEY or type(self).__name__) from None

