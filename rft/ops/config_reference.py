"""Generate docs/config.md from the typed config tree (rft/run/config.py and the sections it composes), so the
reference cannot drift.

`python -m rft.ops.config_reference` rewrites docs/config.md; `--check` exits 1 if the file is not current (a test
runs the check in CI). Either fails, naming every dotted key, when a key has no description.

Every key's description is its field's `help` (`rft.config.option`, declared beside the component that owns it),
sections and the algorithms' options alike. A section's class docstring becomes the paragraph above its table, with
the modules that declare its keys; the `algorithm` section lists every key of the registered algorithms' options
(rft/algorithms/) once, with the algorithms that take it.
"""
from __future__ import annotations

import argparse
import dataclasses
import inspect
import sys
import types
import typing
from pathlib import Path

from rft.algorithms import ALGORITHMS
from rft.algorithms.config import AlgorithmConfig
from rft.algorithms.registry import options_type
from rft.config.fields import HELP, NOT_A_KEY, REST, Section
from rft.run.config import Config

DOC_PATH = Path(__file__).resolve().parents[2] / "docs" / "config.md"

HEADER = """# Configuration reference

Generated from the config sections (`rft/run/config.py` composes them; each key is declared beside its component) by
`python -m rft.ops.config_reference`; a test keeps it current.
Every key can be overridden on the command line with `--set section.key=value`, and any string value may use
`${ENV_VAR}` or `${ENV_VAR:-default}`. Unknown keys, wrong types and out-of-range values are errors that name the
file and the dotted key.
"""


class ConfigReferenceError(ValueError):
    """The reference cannot be generated: keys without a description, or a description written twice. The message
    names every key concerned (`keys`) and says how to fix it."""

    def __init__(self, message: str, keys: list[str]):
        super().__init__(message)
        self.keys = keys


@dataclasses.dataclass(frozen=True)
class Row:
    key: str  # dotted: `section.key`, `section.sub.key`, `section.list[].key`
    type_name: str
    default: str
    description: str  # "" when the field has none


def rows(root: type = Config) -> list[tuple[str, type | None, list[Row]]]:
    """The reference of dataclass `root` as (section name, section class or None, rows) per field of `root`: a field
    that is a dataclass is a section (its nested dataclass fields flattened into it, a list of dataclasses as
    `key[].field`); any other field of `root` (`stages`) is a section of one row."""
    sections: list[tuple[str, type | None, list[Row]]] = []
    hints = typing.get_type_hints(root)
    for f in dataclasses.fields(root):
        tp = hints[f.name]
        if f.metadata.get(NOT_A_KEY):
            continue
        if isinstance(tp, type) and dataclasses.is_dataclass(tp):
            extra = _algorithm_rows(f.name) if tp is AlgorithmConfig else []
            sections.append((f.name, tp, _rows(tp, f.name) + extra))
        else:
            sections.append((f.name, None, [Row(f.name, _type_name(tp), _default(f), f.metadata.get(HELP, ""))]))
    return sections


def _rows(cls: type, prefix: str) -> list[Row]:
    out: list[Row] = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.metadata.get(REST):  # not a key: the section's other keys (an algorithm's options, `_algorithm_rows`)
            continue
        tp = hints[f.name]
        item = typing.get_args(tp)[0] if typing.get_origin(tp) is list else None
        if isinstance(tp, type) and dataclasses.is_dataclass(tp):
            out.extend(_rows(tp, f"{prefix}.{f.name}"))
            continue
        out.append(Row(f"{prefix}.{f.name}", _type_name(tp), _default(f), f.metadata.get(HELP, "")))
        if isinstance(item, type) and dataclasses.is_dataclass(item):
            out.extend(_rows(item, f"{prefix}.{f.name}[]"))
    return out


def _algorithm_rows(prefix: str) -> list[Row]:
    """One row per key of the registered algorithms' options (the first algorithm's field, in registration order),
    its meaning prefixed with the algorithms that take it."""
    takers: dict[str, list[str]] = {}
    fields: dict[str, tuple[type, dataclasses.Field]] = {}
    for name, algorithm in ALGORITHMS.items():
        options = options_type(algorithm)
        for f in dataclasses.fields(options):
            takers.setdefault(f.name, []).append(name)
            fields.setdefault(f.name, (options, f))
    out = []
    for key, (options, f) in fields.items():
        tp = typing.get_type_hints(options)[key]
        text = f.metadata.get(HELP, "")
        out.append(Row(f"{prefix}.{key}", _type_name(tp), _default(f),
                       f"{', '.join(sorted(takers[key]))}: {text}" if text else ""))
    return out


def check_descriptions(root: type = Config) -> None:
    """ConfigReferenceError naming every dotted key of `root` without a description."""
    missing = [row.key for _, _, section in rows(root) for row in section if not row.description]
    if missing:
        raise ConfigReferenceError(
            f"{len(missing)} config keys have no description: {', '.join(missing)}. Describe each with "
            "`option(..., help=...)` where its section (or its algorithm's options class) is declared", missing)


def render(root: type = Config) -> str:
    """docs/config.md's text; ConfigReferenceError (`check_descriptions`) first if a key lacks a description."""
    check_descriptions(root)
    parts = [HEADER]
    for name, cls, section in rows(root):
        parts.append(f"\n## `{name}`\n")
        doc = inspect.getdoc(cls) if cls is not None else None
        if cls is not None and doc and not doc.startswith(cls.__name__ + "("):  # not dataclass's own signature
            parts.append(doc + "\n")
        if cls is not None:
            parts.append(f"Declared by {owners(cls)}.\n")
        parts.append("| key | type | default | meaning |\n|---|---|---|---|")
        parts.extend(f"| `{r.key}` | {r.type_name} | {r.default} | {_cell(r.description)} |" for r in section)
    return "\n".join(parts) + "\n"


def owners(cls: type) -> str:
    """Where a section's keys are declared: `module` (Class, ...) for each class of its MRO that declares fields."""
    by_module: dict[str, list[str]] = {}
    for klass in reversed(cls.__mro__):
        if dataclasses.is_dataclass(klass) and klass is not Section and klass.__dict__.get("__annotations__"):
            path = klass.__module__.replace(".", "/") + ".py"
            by_module.setdefault(path, []).append(klass.__name__)
    return ", ".join(f"`{path}` ({', '.join(names)})" for path, names in reversed(by_module.items()))


def _cell(text: str) -> str:
    """`text` as a table cell: a `|` in it would end the cell."""
    return text.replace("|", "\\|")


def _type_name(tp) -> str:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is typing.Literal:
        return " \\| ".join(f"`{a}`" for a in args)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in args if a is not type(None)) + " or null"
    if origin in (dict, list):
        return f"{origin.__name__}[{', '.join(_type_name(a) for a in args)}]"
    return getattr(tp, "__name__", str(tp))


def _default(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        return f"`{f.default!r}`" if f.default != "" else '`""`'
    if f.default_factory is not dataclasses.MISSING:
        return f"`{f.default_factory()!r}`"
    return "required"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="exit 1 if docs/config.md is not current")
    args = parser.parse_args(argv)
    try:
        text = render()
    except ConfigReferenceError as e:
        print(f"rft.ops.config_reference: {e}", file=sys.stderr)
        return 1
    if args.check:
        current = DOC_PATH.read_text() if DOC_PATH.exists() else ""
        if current != text:
            print(f"{DOC_PATH} is out of date: run `python -m rft.ops.config_reference`", file=sys.stderr)
            return 1
        return 0
    DOC_PATH.write_text(text)
    print(f"wrote {DOC_PATH}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
