"""Optional features and the setup.py extras that install them: a leaf module (standard library only).

`import rft` and the core commands (`rft validate`, `rft run` of a config that uses none of these, `rft topics`,
`rft status`, the trainer and the explorer) need none of the extras; a feature that needs one imports it when it is
used, through `require` (a module) or `check_installed` (a config check, without importing), and an extra that is not
installed is a `MissingExtra` naming the feature, the extra and the pip command. `EXTRAS` names each extra's
top-level modules; setup.py's `extras_require` lists their distributions (tests/integration/test_extras.py keeps
the two equal, and runs the core commands with these modules blocked).
"""
from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType

# extra -> the top-level modules it installs (docs/operations.md, "Optional extras": what uses them)
EXTRAS: dict[str, tuple[str, ...]] = {
    "envs": ("gymnasium", "textarena"),  # the frozenlake and textarena environments and task sets
    "web": ("fastapi", "uvicorn", "starlette"),  # `rft serve`, `rft dashboard`; starlette comes with fastapi
    "ray": ("ray",),  # explorer fleets on a Ray cluster (launch/ray/fleet.py)
    "browser": ("selenium",),  # the dashboard's browser test (tests/e2e/test_run_faults.py)
}


class MissingExtra(ImportError):
    """A feature was used without the extra that installs what it imports. `extra`: the extra's name; `module`: the
    module that is not installed; the message says which feature asked for it and the pip command."""

    def __init__(self, feature: str, extra: str, module: str):
        super().__init__(f"{feature} needs the {extra!r} extra ({module} is not installed): "
                         f"pip install 'rft[{extra}]'", name=module)
        self.feature, self.extra, self.module = feature, extra, module


def extra_of(module: str) -> str | None:
    """The extra that installs `module` (a dotted name: its top-level package decides), or None."""
    top = module.partition(".")[0]
    return next((extra for extra, modules in EXTRAS.items() if top in modules), None)


def require(module: str, *, feature: str) -> ModuleType:
    """`importlib.import_module(module)`; MissingExtra, naming `feature`, when it or a module it imports is one of an
    extra's and is not installed. Any other ImportError passes through unchanged."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        missing = e.name or module
        extra = extra_of(missing) or extra_of(module)
        if extra is None:
            raise
        raise MissingExtra(feature, extra, missing) from None


def check_installed(extra: str, *, feature: str) -> None:
    """MissingExtra naming `feature` unless every module of `extra` is installed; looks them up without importing
    them (a config check pays nothing for a game catalogue it does not load)."""
    for module in EXTRAS[extra]:
        try:
            found = importlib.util.find_spec(module) is not None
        except ImportError:  # an import hook that refuses the module
            found = False
        if not found:
            raise MissingExtra(feature, extra, module)
