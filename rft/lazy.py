"""A module bound to a name now and imported at its first attribute access: a leaf module (standard library only).

Checking a config imports the algorithms (their options are config keys: rft.run.loading), whose losses need torch.
With `torch = lazy("torch")` in rft/algorithms/ the commands that only read a config or the broker (`rft validate`,
`rft status`, `rft topics`, `rft run`'s launcher, its task publisher and dashboard) never import torch; the first
loss computed imports it (tests/integration/test_cli_without_torch.py checks which commands stay without it). Each
attribute read once is kept on the stand-in, so a loss's later reads of `torch.where` and the like are plain
attribute reads; an attribute the module gains later is found when first read.
"""
from __future__ import annotations

import importlib
from types import ModuleType


class LazyModule(ModuleType):
    """Stands for the module of its name; the first read of an attribute imports that module and keeps the value."""

    def __getattr__(self, attribute: str):  # only for attributes not yet kept
        value = getattr(importlib.import_module(self.__name__), attribute)
        setattr(self, attribute, value)
        return value


def lazy(name: str) -> ModuleType:
    """The module `name` (dotted: "torch.nn.functional"), imported when an attribute of it is first read."""
    return LazyModule(name)
