"""A module bound to a name now and imported at its first attribute access: a leaf module (standard library only).

Checking a config imports the algorithms (their options are config keys: rft.run.loading), whose losses need torch.
With `torch = lazy("torch")` in rft/algorithms/ the commands that only read a config or the broker (`rft validate`,
`rft status`, `rft topics`, `rft run`'s launcher, its task publisher and dashboard) never import torch, about 2 s of
CPU each on a 2-core machine; the first loss computed imports it (tests/unit/test_optional_extras.py checks which
commands stay without it). The module is looked up in `sys.modules` on each access (a dict lookup; nothing is
copied, so attributes torch adds later are seen too).
"""
from __future__ import annotations

import importlib
from types import ModuleType


class LazyModule(ModuleType):
    """Stands for the module of its name; any attribute imports that module (once) and is read from it."""

    def __getattr__(self, attribute: str):
        return getattr(importlib.import_module(self.__name__), attribute)


def lazy(name: str) -> ModuleType:
    """The module `name` (dotted: "torch.nn.functional"), imported when an attribute of it is first read."""
    return LazyModule(name)
