"""Resolving `package.module:name` import paths, the escape hatch of every registry (algorithms, rewards,
workflows, environments, admission). Errors name what was being resolved and the path."""
from __future__ import annotations

import difflib
import importlib
from typing import Any, Callable


def import_object(spec: str, *, what: str, error: type[Exception] = ValueError) -> Any:
    """The callable at `package.module:attr` (attr may be dotted); `error(message)` if there is none."""
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise error(f"{what} import path {spec!r} must look like package.module:name")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise error(f"{what} import path {spec!r}: cannot import module {module_name!r}: {e}") from None
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise error(f"{what} import path {spec!r}: module {module_name!r} has no attribute {attr!r} "
                        f"(it has no callable {attr!r})")
        obj = getattr(obj, part)
    if not callable(obj):
        raise error(f"{what} import path {spec!r} is a {type(obj).__name__}, not a callable")
    return obj


def resolve_registered(name: str, registry: dict[str, Any], *, what: str, error: type[Exception] = ValueError) -> Any:
    """`registry[name]`, or the callable at an import path `package.module:attr`; `error(message)` naming `what`,
    with a did-you-mean and the registered names, if neither."""
    if ":" in name:
        return import_object(name, what=what, error=error)
    if name not in registry:
        near = difflib.get_close_matches(name, registry, n=1)
        hint = f"did you mean {near[0]!r}? " if near else ""
        raise error(f"{what}: unknown name {name!r} ({hint}registered: {', '.join(sorted(registry))}; "
                    "or an import path 'package.module:name')")
    return registry[name]


def registrar(registry: dict[str, Any], what: str, *, error: type[Exception] = ValueError) -> Callable[[str], Callable[[Any], Any]]:
    """`register = registrar(REGISTRY, "thing")` makes `@register(name)`, a decorator adding a class or function to
    the registry under `name`; a name registered twice is `error`."""
    def register(name: str) -> Callable[[Any], Any]:
        def add(obj: Any) -> Any:
            if name in registry:
                raise error(f"{what} {name!r} is already registered")
            registry[name] = obj
            return obj
        return add
    return register
