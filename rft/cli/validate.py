"""`rft validate`: load a config as `rft run` would (every check, registry names and the model on disk included)
and report, with the largest experience record it can produce and where its parts go (rft.run.record_size);
exit 2 naming the bad key."""
from __future__ import annotations

import argparse
import sys

from rft.cli.commandline import add_config_arguments, config_from_args
from rft.run.record_size import describe, estimate_record
from rft.trainer.collect import collection_warnings


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="rft validate", description="Validate a run config.")
    add_config_arguments(parser)
    parser.add_argument("--print", action="store_true", help="print the resolved config as YAML")
    args = parser.parse_args(argv)
    cfg = config_from_args(args, need_model=True)
    for warning in collection_warnings(cfg):
        print(f"rft validate: warning: {warning}", file=sys.stderr)
    if args.print:
        print(cfg.to_yaml(), end="")
    else:
        print(f"{args.config}: valid (run {cfg.run.name!r}, mode {cfg.run.mode})")
        lines, warnings = describe(cfg, estimate_record(cfg))
        print("\n".join(lines))
        for warning in warnings:
            print(f"warning: {warning}")
    return 0
