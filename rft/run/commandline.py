"""What every rft command shares: the config arguments (loaded and fully checked, exit 2 on an error), stop
signals, and dying with the parent process. Commands import this module, never `rft.cli` (the dispatcher)."""
from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading

from rft.config import Config, ConfigError
from rft.processes import die_with_parent  # noqa: F401 - re-exported: commands import it from here
from rft.run.loading import load_run_config


def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    """The config file plus `--set a.b.c=value` overrides, shared by every command that takes a config."""
    parser.add_argument("config", help="YAML run config")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override any config key, e.g. --set trainer.lr=1e-5 (repeatable)")


def config_from_args(args: argparse.Namespace, *, need_model: bool = False) -> Config:
    """Load the config named by `add_config_arguments` for a run (registry names checked too; `need_model`: the
    model must be on disk here, rft.run.loading.check_model); on error print it and exit 2."""
    try:
        return load_run_config(args.config, args.overrides, need_model=need_model)
    except ConfigError as e:
        print(f"rft: invalid config: {e}", file=sys.stderr)
        raise SystemExit(2) from None


def install_stop_signals(stop: threading.Event) -> None:
    """SIGTERM / SIGINT set `stop` (finish the work in progress, then leave); a second one aborts. A flag, not an
    exception: kafka-python's network code catches BaseException and can swallow a KeyboardInterrupt."""
    def on_signal(signum, frame):
        if stop.is_set():
            raise KeyboardInterrupt  # second signal: abort now
        logging.getLogger("rft").info("signal %d: finishing the work in progress, then leaving", signum)
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
