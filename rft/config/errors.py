"""The one error type of configuration: raised before any process starts, naming the source and the dotted key."""
from __future__ import annotations


class ConfigError(ValueError):
    """An invalid configuration: the message names the source and the dotted key."""
