"""YAML to typed sections: parse (a key named twice is an error), expand `${ENV}` references, apply `--set a.b=v`
overrides, rename deprecated keys, and build the dataclass tree with type coercion and each section's checks.

Contract: every error is a `ConfigError` whose message starts with the source (file name, `<dict>` or `<defaults>`)
and names the full dotted key (`data.mix[2].weight`); an unknown key comes with a did-you-mean. `${NAME}` and
`${NAME:-default}` expand from the environment; a whole-value reference takes the YAML type of what it expands to.
Nothing here knows the sections: the root class is a parameter.
"""
from __future__ import annotations

import dataclasses
import difflib
import json
import logging
import math
import os
import re
import types
import typing
from collections.abc import Mapping
from typing import Any, Literal

import yaml

from rft.config.errors import ConfigError
from rft.config.fields import NOT_A_KEY, SectionError, rest_field

log = logging.getLogger(__name__)

_YAML11_FLOAT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+")
_ENV_REF = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")


class _UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing a mapping that names a key twice (PyYAML keeps the last and says nothing, so a
    section written twice loses the first silently). Keys merged in by `<<` may still be overridden."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        if isinstance(node, yaml.MappingNode):
            seen: dict[Any, yaml.Node] = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node, deep=True)
                try:
                    first = seen.setdefault(key, key_node)
                except TypeError:  # an unhashable key: the base class names it
                    break
                if first is not key_node:
                    raise yaml.constructor.ConstructorError(
                        "while constructing a mapping", node.start_mark,
                        f"key {key!r} appears twice (first on line {first.start_mark.line + 1})", key_node.start_mark)
        return super().construct_mapping(node, deep=deep)


def load_yaml(text: str) -> Any:
    """`yaml.safe_load`, except that a mapping naming a key twice is a yaml.YAMLError (naming the key and both
    lines)."""
    return yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 -- a SafeLoader subclass


def yaml_error(source: str, error: yaml.YAMLError) -> str:
    """One line naming `source:line:column` (1-based) and what PyYAML found wrong there."""
    mark = getattr(error, "problem_mark", None) or getattr(error, "context_mark", None)
    where = f"{source}:{mark.line + 1}:{mark.column + 1}" if mark is not None else source
    problem = getattr(error, "problem", None) or str(error).splitlines()[0]
    context = getattr(error, "context", None)
    return f"{where}: not valid YAML: {problem}" + (f" ({context})" if context else "")


def read_mapping(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The top-level mapping of the YAML file `path` (empty for an empty file)."""
    source = str(path)
    try:
        text = open(path).read()
    except OSError as e:
        raise ConfigError(f"{source}: cannot read config file: {e.strerror}") from None
    try:
        raw = load_yaml(text) or {}
    except yaml.YAMLError as e:
        raise ConfigError(yaml_error(source, e)) from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: top level must be a mapping of sections, got {type(raw).__name__}")
    return raw


def interpolate(node: Any, source: str, key: str, refs: dict[str, str]) -> Any:
    """`node` with its `${NAME}` / `${NAME:-default}` references expanded; `refs` gets {dotted key: the string as
    written} of each value that held one."""
    if isinstance(node, dict):
        return {k: interpolate(v, source, f"{key}.{k}" if key else str(k), refs) for k, v in node.items()}
    if isinstance(node, list):
        return [interpolate(v, source, f"{key}[{i}]", refs) for i, v in enumerate(node)]
    if isinstance(node, str) and "${" in node:
        refs[key] = node

        def replace(m: re.Match[str]) -> str:
            name, default = m.group(1), m.group(2)
            if name in os.environ:
                return os.environ[name]
            if default is not None:
                return default
            raise ConfigError(f"{source}: {key}: environment variable ${{{name}}} is not set "
                              f"(set it, or write ${{{name}:-default}})")
        value = _ENV_REF.sub(replace, node)
        return yaml.safe_load(value) if _ENV_REF.fullmatch(node) and value else value
    return node


def apply_override(raw: dict[str, Any], item: str, renames: Mapping[str, str] = {}) -> str:
    """Set `item` (`a.b.c=value`, the value read as YAML) in the raw mapping `raw`, creating sections; a deprecated
    key in `renames` is set under its new name (with a one-line warning). Returns the dotted key set."""
    if "=" not in item:
        raise ConfigError(f"--set {item!r}: expected key.path=value")
    key, value = item.split("=", 1)
    key = renamed(key.strip(), renames, "--set")
    parts = key.split(".")
    node = raw
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"--set {item!r}: {part} is not a section")
    try:
        node[parts[-1]] = yaml.safe_load(value) if value != "" else ""
    except yaml.YAMLError:
        node[parts[-1]] = value
    return key


def renamed(key: str, renames: Mapping[str, str], where: str) -> str:
    """The current name of the dotted `key` (itself unless `renames` lists it), warning once per use."""
    new = renames.get(key)
    if new is None:
        return key
    log.warning("%s: %s is deprecated, use %s (it means the same)", where, key, new)
    return new


def move_renamed_keys(raw: dict[str, Any], renames: Mapping[str, str], source: str, prefix: str = "") -> dict[str, Any]:
    """A copy of the raw two-level mapping `raw` with each deprecated `section.key` of `renames` moved to its new
    name; ConfigError when both names are written."""
    out = {k: dict(v) if isinstance(v, dict) else v for k, v in raw.items()}
    for old, new in renames.items():
        old_section, old_key = old.split(".", 1)
        new_section, new_key = new.split(".", 1)
        body = out.get(old_section)
        if not isinstance(body, dict) or old_key not in body:
            continue
        target = out.setdefault(new_section, {})
        if not isinstance(target, dict):
            continue  # the builder names the section that is not a mapping
        if new_key in target:
            raise ConfigError(f"{source}: {prefix}{old}: is the deprecated name of {prefix}{new}, which is also set; "
                              f"keep {prefix}{new}")
        target[new_key] = body.pop(old_key)
        renamed(old, renames, f"{source}: {prefix}".rstrip(": ") if prefix else source)
    return out


def build(cls: type, raw: Any, source: str, prefix: str = "") -> Any:
    """The dataclass `cls` built from the mapping `raw`: unknown keys refused with a did-you-mean, values coerced to
    the field types, each section's own checks run; ConfigError naming `source` and the key under `prefix`."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: {prefix or '<top>'}: expected a mapping, got {type(raw).__name__}")
    hints = typing.get_type_hints(cls)
    rest = rest_field(cls)
    fields = [f for f in dataclasses.fields(cls) if f.init and not f.metadata.get(NOT_A_KEY)]
    names = [f.name for f in fields if f.name != rest]
    if rest is not None:
        own = {k: v for k, v in raw.items() if k in names}
        raw = {**own, rest: {str(k): v for k, v in raw.items() if k not in names}}
    for key in raw:
        if key not in names and key != rest:
            path = f"{prefix}.{key}" if prefix else str(key)
            near = difflib.get_close_matches(str(key), names, n=1)
            hint = f" (did you mean '{near[0]}'?)" if near else f" (valid keys: {', '.join(names)})"
            raise ConfigError(f"{source}: {path}: unknown key{hint}")
    kwargs: dict[str, Any] = {}
    for f in fields:
        path = f"{prefix}.{f.name}" if prefix else f.name
        if f.name == rest:
            kwargs[f.name] = raw[rest]  # as written: the module that owns these keys builds them
        elif f.name in raw:
            kwargs[f.name] = _coerce(hints[f.name], raw[f.name], source, path)
        elif dataclasses.is_dataclass(hints[f.name]):
            kwargs[f.name] = build(hints[f.name], {}, source, path)
    try:
        return cls(**kwargs)
    except SectionError as e:  # a section's own checks name the key relative to the section
        raise ConfigError(f"{source}: {prefix + '.' if prefix else ''}{e.key}: {e.message}") from None
    except ConfigError as e:  # options classes of other modules (an algorithm's) name their keys themselves
        message = str(e)
        if message.startswith(source):
            raise
        if prefix and not message.startswith(f"{prefix}."):
            message = f"{prefix}.{message}"
        raise ConfigError(f"{source}: {message}") from None


def _coerce(tp: Any, value: Any, source: str, path: str) -> Any:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if dataclasses.is_dataclass(tp):
        return build(typing.cast(type, tp), value if value is not None else {}, source, path)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _coerce(inner[0], value, source, path)
    if origin is Literal:
        if value not in args:
            near = difflib.get_close_matches(str(value), [str(a) for a in args], n=1)
            hint = f" (did you mean '{near[0]}'?)" if near else ""
            raise ConfigError(f"{source}: {path}: must be one of {', '.join(map(str, args))}; got {value!r}{hint}")
        return value
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{source}: {path}: expected a mapping, got {_describe(value)}")
        return {str(k): _coerce(args[1], v, source, f"{path}.{k}") for k, v in value.items()}
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{source}: {path}: expected a list, got {_describe(value)}")
        return [_coerce(args[0], v, source, f"{path}[{i}]") for i, v in enumerate(value)]
    if tp is Any:
        return value
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp is float and isinstance(value, str) and _YAML11_FLOAT.fullmatch(value.strip()):
        value = float(value)  # PyYAML (YAML 1.1) reads `1e-5` as a string; everyone means a float
    if tp is float and isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{source}: {path}: must be a finite number, got {value}")
    if (tp is bool) != isinstance(value, bool) or not isinstance(value, tp):
        raise ConfigError(f"{source}: {path}: expected {tp.__name__}, got {_describe(value)}")
    return value


def _describe(value: Any) -> str:
    return f"{type(value).__name__} {json.dumps(value, default=str)[:60]}"
