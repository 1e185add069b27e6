"""Resolving `package.module:name` import paths, the escape hatch of every registry (algorithms, rewards,
workflows, environments, admission). Errors name what was being resolved and the path."""
from __future__ import annotations

import importlib
from typing import Any


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
