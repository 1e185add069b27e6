"""The command line every serve-mode part shares (`rft serve`, `rft joiner`)."""
from __future__ import annotations

import argparse
import logging
from collections.abc import Callable

from rft.cli.commandline import add_config_arguments, config_from_args


def part_config(prog: str, description: str, argv: list[str],
                add_arguments: Callable[[argparse.ArgumentParser], None] | None = None):
    """The command line of a serve-mode part (`rft serve`, `rft joiner`): CONFIG and `--set` (plus `add_arguments`),
    the config loaded and checked, and its logging set up. Returns (config, args); exits 2 after one line on stderr
    when the config names no broker (`embedded`: rft.cli.commandline.require_broker)."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    add_config_arguments(parser)
    if add_arguments is not None:
        add_arguments(parser)
    args = parser.parse_args(argv)
    cfg = config_from_args(args, joins_broker=prog)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {prog.split()[-1]} %(levelname)s %(message)s")
    logging.getLogger("kafka").setLevel(logging.WARNING)
    return cfg, args
