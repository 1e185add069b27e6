"""`rft replay CONFIG [--from X] [--to Y] [--topic T]`: offline training from a recorded experiences topic, as
`rft run` with run.mode offline (the range and topic given here become replay.start, replay.end, replay.topic).
Exit 2 when the config names no broker for an existing topic (`embedded`), or the algorithm cannot train on
recorded experiences as configured; otherwise `rft run`'s exit code (rft/cli/launcher.py)."""
from __future__ import annotations

import argparse
import sys

from rft.algorithms import REPLAY_HINT, build_algorithm
from rft.cli.commandline import add_config_arguments, config_from_args, require_broker
from rft.cli.launcher import run_until_stopped


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="rft replay", description="Offline training from an experiences topic. "
                                     "X and Y are P:O[,P:O...] offsets, ISO 8601 times or epoch milliseconds.")
    add_config_arguments(parser)
    parser.add_argument("--from", dest="start", default=None, help="start (default: replay.start, or the beginning)")
    parser.add_argument("--to", dest="end", default=None, help="end, exclusive (default: replay.end, or the end)")
    parser.add_argument("--topic", default=None, help="topic to replay (default: replay.topic, or the run's)")
    args = parser.parse_args(argv)
    args.overrides.append("run.mode=offline")
    for key, value in (("start", args.start), ("end", args.end), ("topic", args.topic)):
        if value is not None:
            args.overrides.append(f"replay.{key}={value}")
    cfg = config_from_args(args, need_model=True)
    if not cfg.replay.from_data:  # replays an existing topic, on the broker that holds it
        require_broker(cfg, "rft replay")
    if not build_algorithm(cfg.algorithm).supports_replay:
        print(f"rft replay: algorithm {cfg.algorithm.name!r} cannot train on recorded experiences as configured "
              f"({REPLAY_HINT})", file=sys.stderr)
        return 2
    return run_until_stopped(cfg)
