"""docs/config.md is generated from the config tree; this keeps it current (regenerate with
`python -m rft.ops.config_reference`) and every key described."""
from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from rft.config import option
from rft.ops.config_reference import ConfigReferenceError, check_descriptions, field_descriptions, main, render, rows


def test_config_reference_is_current():
    assert main(["--check"]) == 0, "docs/config.md is stale: run `python -m rft.ops.config_reference`"


def test_every_config_key_has_a_description():
    check_descriptions()  # raises naming each key without one
    keys = [row.key for _, _, section in rows() for row in section]
    assert len(keys) > 150 and "run.mode" in keys and "eval.sets[].format" in keys  # the whole tree is walked


# Options classes described by comments, as an algorithm's options are (rft/algorithms/).
@dataclass
class _Item:
    described: int = 0  # on the field's line
    bare: int = 0


@dataclass
class _Nested:
    deep: str = ""


@dataclass
class _Section:
    # above the field,
    # over two lines
    block: str = "#not a comment"
    trailing: float = 1.0  # on its line
    # a note for the fields below, apart from them

    undescribed: bool = False
    spread: str = ("one"  # a default over two lines,
                   "two")  # described on both
    nested: _Nested = field(default_factory=_Nested)
    items: list[_Item] = field(default_factory=list)  # a list of sections


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


@dataclass
class _Twice:
    # above
    key: int = 0  # and on the line


def test_descriptions_are_read_above_and_on_the_field_line():
    assert field_descriptions(_Section) == {
        "block": "above the field, over two lines", "trailing": "on its line",
        "spread": "a default over two lines, described on both", "items": "a list of sections"}
    assert field_descriptions(_Item) == {"described": "on the field's line"}


def test_every_undescribed_key_is_named():
    with pytest.raises(ConfigReferenceError) as e:
        render(_Root)
    missing = ["section.undescribed", "section.nested.deep", "section.items[].bare", "loose"]
    assert e.value.keys == missing
    for key in missing:
        assert key in str(e.value)
    assert "section.block" not in str(e.value)


def test_a_field_described_twice_is_an_error():
    with pytest.raises(ConfigReferenceError, match=r"_Twice.key: described twice"):
        field_descriptions(_Twice)


def test_the_bench_help_names_every_registered_benchmark():
    from benchmarks.main import BENCHMARKS
    from rft.cli import COMMANDS

    help_text = COMMANDS["bench"][1]
    assert [name for name in BENCHMARKS if name not in help_text] == [], f"`rft --help` says {help_text!r}"
