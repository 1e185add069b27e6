"""The bottom layer of configuration: how sections declare keys (`option`, `Range`, `Section`), how YAML becomes
typed sections (`loader`), and how secrets stay out of what is written (`secrets`). It knows no section: each
component declares its own beside itself (e.g. rft/explorer/config.py), and the run's root config composes them
(rft/run/config.py). Imports nothing of rft."""
from rft.config.errors import ConfigError
from rft.config.fields import (
    COUNT,
    FINITE,
    OPTIONAL,
    PORT,
    PORT_OR_ANY,
    PORT_OR_OFF,
    POSITIVE,
    PROBABILITY,
    SEED,
    Range,
    Section,
    SectionError,
    at_least,
    option,
    section,
)
from rft.config.loader import build, load_yaml, yaml_error

__all__ = ["COUNT", "FINITE", "OPTIONAL", "PORT", "PORT_OR_ANY", "PORT_OR_OFF", "POSITIVE", "PROBABILITY", "SEED",
           "ConfigError", "Range", "Section", "SectionError", "at_least", "build", "build_section", "load_yaml",
           "option", "section", "yaml_error"]


def build_section(cls: type, raw: object, *, source: str, prefix: str) -> object:
    """The section `cls` built from the mapping `raw` with the loader's checks, for sections whose keys another
    module owns (an algorithm's options, rft/algorithms/)."""
    return build(cls, raw, source, prefix)
