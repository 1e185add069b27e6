"""Secrets are never written or shown. A value that came from `${ENV}` is written as the reference (whoever reads the
file expands it again from its own environment); a value under a key named like a secret in a free-form mapping
(a `dict[str, Any]` key such as kafka.security, in a stage's overrides too; rft's own typed keys hold no secrets)
is written as REDACTED."""
from __future__ import annotations

import dataclasses
import functools
import re
import types
import typing
from typing import Any

from rft.config.fields import NOT_A_KEY, REST

SECRET_NAME = re.compile(r"key|token|passw|secret|credential", re.IGNORECASE)
REDACTED = "<redacted>"


def redacted(tree: dict[str, Any], env_refs: dict[str, str], root: type) -> dict[str, Any]:
    """The YAML-shaped `tree` of a config of class `root` with every secret replaced (see the module docstring)."""
    def walk(node: Any, path: str) -> Any:
        if path in env_refs:
            return env_refs[path]
        if isinstance(node, dict):
            return {k: walk(v, f"{path}.{k}" if path else str(k)) for k, v in node.items()}
        if isinstance(node, list):
            return [walk(v, f"{path}[{i}]") for i, v in enumerate(node)]
        return REDACTED if node not in (None, "") and is_secret_key(path, root) else node

    return typing.cast(dict[str, Any], walk(tree, ""))


def secret_values(tree: dict[str, Any], env_refs: dict[str, str], root: type) -> dict[str, Any]:
    """{dotted key: value} of the secrets `redacted` writes as REDACTED (values not from `${ENV}`)."""
    shown, actual = flatten(redacted(tree, env_refs, root)), flatten(tree)
    return {key: actual[key] for key, value in shown.items() if value == REDACTED and actual.get(key) != REDACTED}


def flatten(node: Any, path: str = "") -> dict[str, Any]:
    """{dotted key: value} of every leaf of a YAML-shaped tree (list items as `key[i]`; an empty mapping or list is
    no leaf)."""
    if isinstance(node, dict):
        return {k: v for key, value in node.items()
                for k, v in flatten(value, f"{path}.{key}" if path else str(key)).items()}
    if isinstance(node, list):
        return {k: v for i, value in enumerate(node) for k, v in flatten(value, f"{path}[{i}]").items()}
    return {path: node}


def pattern(key: str) -> str:
    """A dotted key with its list indexes dropped (`eval.sets[2].seed` -> `eval.sets[].seed`)."""
    return re.sub(r"\[\d+\]", "[]", key)


def is_secret_key(path: str, root: type) -> bool:
    """Whether the dotted key `path` of a `root` config names a secret: its last part is named like one
    (SECRET_NAME) and it lies in a free-form mapping."""
    general = pattern(re.sub(r"^stages\[\d+\]\.", "", path))
    name = general.rsplit(".", 1)[-1]
    return bool(SECRET_NAME.search(name)) and any(general.startswith(f + ".") for f in free_form_keys(root))


@functools.cache
def free_form_keys(root: type) -> tuple[str, ...]:
    """The dotted keys (list items as `[]`) typed `dict[str, Any]`: mappings whose keys rft does not define."""
    out: list[str] = []

    def free(tp: Any) -> bool:
        return typing.get_origin(tp) is dict and typing.get_args(tp)[1] is Any

    def walk(cls: type, prefix: str) -> None:
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            tp, args = hints[f.name], typing.get_args(hints[f.name])
            if f.metadata.get(REST) or f.metadata.get(NOT_A_KEY) or not f.init:
                continue
            if dataclasses.is_dataclass(tp):
                walk(typing.cast(type, tp), f"{prefix}{f.name}.")
            elif typing.get_origin(tp) is list and args and dataclasses.is_dataclass(args[0]):
                walk(typing.cast(type, args[0]), f"{prefix}{f.name}[].")
            elif free(tp) or (typing.get_origin(tp) in (typing.Union, types.UnionType) and any(map(free, args))):
                out.append(f"{prefix}{f.name}")

    walk(root, "")
    return tuple(out)
