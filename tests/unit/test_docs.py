"""docs/config.md is generated from the config tree; this keeps it current (regenerate with
`python -m rft.ops.config_reference`) and every key described."""
from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from rft.config import option
from rft.ops.config_reference import ConfigReferenceError, check_descriptions, main, render, rows


def test_config_reference_is_current():
    assert main(["--check"]) == 0, "docs/config.md is stale: run `python -m rft.ops.config_reference`"


def test_every_config_key_has_a_description():
    check_descriptions()  # raises naming each key without one
    keys = [row.key for _, _, section in rows() for row in section]
    assert len(keys) > 150 and "run.mode" in keys and "eval.sets[].format" in keys  # the whole tree is walked
    assert "algorithm.clip_eps" in keys and "algorithm.gamma" in keys  # and every registered algorithm's options


@dataclass
class _KeyItem:
    described: int = option(0, help="an item's key")
    bare: int = option(0, help="")


@dataclass
class _KeyNested:
    deep: str = option("", help="")


@dataclass
class _KeySection:
    block: str = option("#not a comment", help="described")
    undescribed: bool = option(False, help="")
    nested: _KeyNested = field(default_factory=_KeyNested)
    items: list[_KeyItem] = option(factory=list, help="a list of sections")


@dataclass
class _Root:
    """A config tree declared as rft's sections are (`option(..., help=...)`), with keys left undescribed."""
    section: _KeySection = field(default_factory=_KeySection)
    loose: int = option(0, help="")


def test_every_undescribed_key_is_named():
    with pytest.raises(ConfigReferenceError) as e:
        render(_Root)
    missing = ["section.undescribed", "section.nested.deep", "section.items[].bare", "loose"]
    assert e.value.keys == missing
    for key in missing:
        assert key in str(e.value)
    assert "section.block" not in str(e.value)


def test_the_bench_help_names_every_registered_benchmark():
    from benchmarks.main import BENCHMARKS
    from rft.cli import COMMANDS

    help_text = COMMANDS["bench"][1]
    assert [name for name in BENCHMARKS if name not in help_text] == [], f"`rft --help` says {help_text!r}"
