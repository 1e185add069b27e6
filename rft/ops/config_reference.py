"""Generate docs/config.md from the typed config tree (rft/config.py), so the reference cannot drift.

`python -m rft.ops.config_reference` rewrites docs/config.md; `--check` exits 1 if the file is not current (a test
runs the check in CI). Descriptions are the trailing `# comments` of the fields in rft/config.py.
"""
from __future__ import annotations

import argparse
import dataclasses
import inspect
import re
import sys
import typing
from pathlib import Path

from rft import config as config_module

DOC_PATH = Path(__file__).resolve().parents[2] / "docs" / "config.md"
_FIELD_LINE = re.compile(r"^\s+(\w+):[^#]*?(?:#\s*(.*))?$")

HEADER = """# Configuration reference

Generated from `rft/config.py` by `python -m rft.ops.config_reference`; a test keeps it current.
Every key can be overridden on the command line with `--set section.key=value`, and any string value may use
`${ENV_VAR}` or `${ENV_VAR:-default}`. Unknown keys, wrong types and out-of-range values are errors that name the
file and the dotted key.
"""


def _comments(cls: type) -> dict[str, str]:
    out = {}
    for line in inspect.getsource(cls).splitlines()[1:]:
        m = _FIELD_LINE.match(line)
        if m and m.group(2):
            out[m.group(1)] = m.group(2).strip()
    return out


def _type_name(tp) -> str:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is typing.Literal:
        return " \\| ".join(f"`{a}`" for a in args)
    if origin is typing.Union:
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


def render() -> str:
    parts = [HEADER]
    root_hints = typing.get_type_hints(config_module.Config)
    for section in dataclasses.fields(config_module.Config):
        cls = root_hints[section.name]
        if not dataclasses.is_dataclass(cls):  # a top-level key that is not a section (`stages`)
            parts.append(f"\n## `{section.name}`\n\n| key | type | default | meaning |\n|---|---|---|---|\n"
                         f"| `{section.name}` | {_type_name(cls)} | {_default(section)} | "
                         f"{_comments(config_module.Config).get(section.name, '')} |")
            continue
        doc = inspect.getdoc(cls)
        parts.append(f"\n## `{section.name}`\n")
        if doc and not doc.startswith(cls.__name__ + "("):
            parts.append(doc + "\n")
        parts.append("| key | type | default | meaning |\n|---|---|---|---|")
        parts.extend(_rows(cls, section.name))
    return "\n".join(parts) + "\n"


def _rows(cls: type, prefix: str) -> list[str]:
    """One row per field; a field that is a section is followed by its own fields' rows, a list of sections (e.g.
    `eval.sets`) by its items' fields as `key[].field`."""
    rows = []
    hints, comments = typing.get_type_hints(cls), _comments(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        item = typing.get_args(tp)[0] if typing.get_origin(tp) is list else None
        if dataclasses.is_dataclass(tp):
            rows.extend(_rows(tp, f"{prefix}.{f.name}"))
            continue
        rows.append(f"| `{prefix}.{f.name}` | {_type_name(tp)} | {_default(f)} | {comments.get(f.name, '')} |")
        if item is not None and dataclasses.is_dataclass(item):
            rows.extend(_rows(item, f"{prefix}.{f.name}[]"))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--check", action="store_true", help="exit 1 if docs/config.md is not current")
    args = parser.parse_args(argv)
    text = render()
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
