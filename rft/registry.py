"""Registries: a config names a component by a registered name or by an import path `package.module:attr`.

Every registry of rft (algorithms, rewards, workflows, multi-turn environments, task selectors, experience
operators, replay priorities) is a `Registry`, so they resolve alike and fail alike: the error names the config
key, what kind of name it is, a close registered name if there is one, and every registered name:

    explorer.reward: unknown reward 'exact_mach' (did you mean 'exact_match'?); registered: countdown, ...;
    or an import path 'package.module:name'

Built-in components register themselves when their module is imported (`@REGISTRY.register(name)`); each
registry lives in a small module below its built-ins, and the package `__init__` imports the built-ins, so
importing the package fills its registry. This module imports nothing of rft.
"""
from __future__ import annotations

import difflib
import importlib
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Generic, TypeVar

T = TypeVar("T")


class RegistryError(ValueError):
    """An unknown name, an import path that does not resolve, or a name registered twice (the default error of a
    Registry; a registry may raise its own ValueError subclass instead)."""


def import_object(spec: str, *, key: str, noun: str = "", error: type[Exception] = RegistryError) -> Any:
    """The callable at `package.module:attr` (attr may be dotted), for the config key `key`; `error(message)`
    naming the key (and `noun`, the kind of thing, when given) and saying why if there is none."""
    label = f"{key}: {noun}" if noun else key
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise error(f"{label} import path {spec!r} must look like package.module:name")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise error(f"{label} import path {spec!r}: cannot import module {module_name!r}: {e}") from None
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise error(f"{label} import path {spec!r}: module {module_name!r} has no attribute {attr!r} "
                        f"(it has no callable {attr!r})")
        obj = getattr(obj, part)
    if not callable(obj):
        raise error(f"{label} import path {spec!r} is a {type(obj).__name__}, not a callable")
    return obj


class Registry(Mapping, Generic[T]):
    """Names -> registered objects (read-only as a mapping; `register` / `add` grow it).

    `noun` is the kind of name in error messages ("unknown reward 'x'"; default "name"); `error` is the exception
    class raised for unknown names, bad import paths and names registered twice.
    """

    def __init__(self, what: str, *, noun: str = "", error: type[Exception] = RegistryError):
        self.what, self.noun, self.error = what, noun, error
        self._entries: dict[str, T] = {}

    def __getitem__(self, name: str) -> T:
        return self._entries[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def add(self, name: str, obj: T) -> T:
        """Register `obj` under `name`; a name registered twice is an error."""
        if name in self._entries:
            raise self.error(f"{self.what} {name!r} is already registered ({self._entries[name]!r} and {obj!r})")
        self._entries[name] = obj
        return obj

    def register(self, name: str) -> Callable[[T], T]:
        """Decorator form of `add`: `@REGISTRY.register("name")` above a class or function."""
        return lambda obj: self.add(name, obj)

    def resolve(self, spec: str, *, key: str) -> T:
        """The object registered as `spec`, or the callable at the import path `spec` (it contains ':'); `error`
        naming the config `key` otherwise."""
        if ":" in spec:
            return import_object(spec, key=key, noun=self.noun, error=self.error)
        if spec not in self._entries:
            raise self.error(f"{key}: {self.unknown(spec)}")
        return self._entries[spec]

    def unknown(self, spec: str) -> str:
        """Why `spec` does not resolve: a close match and every registered name."""
        near = difflib.get_close_matches(spec, list(self._entries), n=1)
        hint = f" (did you mean {near[0]!r}?)" if near else ""
        return (f"unknown {self.noun or 'name'} {spec!r}{hint}; registered: {', '.join(sorted(self._entries))}; "
                "or an import path 'package.module:name'")
