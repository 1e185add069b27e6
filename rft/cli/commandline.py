"""What every rft command shares: the config arguments (loaded and fully checked, exit 2 on an error), the refusal of
`kafka.bootstrap_servers: embedded` by a part that joins a run's broker, stop signals, and dying with the parent
process. Commands import this module, never `rft.cli` (the dispatcher)."""
from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
from pathlib import Path

from rft.config import ConfigError
from rft.processes import die_with_parent  # noqa: F401 - re-exported: commands import it from here
from rft.run.config import Config
from rft.run.loading import load_run_config


def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    """The config file plus `--set a.b.c=value` overrides, shared by every command that takes a config."""
    parser.add_argument("config", help="YAML run config")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override any config key, e.g. --set trainer.lr=1e-5 (repeatable)")


def config_from_args(args: argparse.Namespace, *, need_model: bool = False, joins_broker: str = "") -> Config:
    """Load the config named by `add_config_arguments` for a run (registry names checked too; `need_model`: the
    model must be on disk here, rft.run.loading.check_model); on error print it and exit 2. `joins_broker`: the
    command (e.g. "rft explorer") when it joins a run's broker: `require_broker` then refuses `embedded`."""
    try:
        cfg = load_run_config(args.config, args.overrides, need_model=need_model)
    except ConfigError as e:
        print(f"rft: invalid config: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    if joins_broker:
        require_broker(cfg, joins_broker)
    return cfg


EMBEDDED = "embedded"  # kafka.bootstrap_servers: a local broker that `rft run` starts for the parts it runs


def embedded_broker_error(part: str, *, where: str = "kafka.bootstrap_servers",
                          fix: str = "--set kafka.bootstrap_servers=HOST:PORT", run_dir: Path | None = None) -> str:
    """The one error text for `part` (a command: "rft trainer", "rft topics"...), which joins a running broker, given
    `embedded` in `where`: what is wrong and how to fix it (`fix`: the option that gives the address; or the config
    `rft run` wrote, named when it exists under `run_dir`). No prefix: the caller puts its command's name first."""
    written = Path(run_dir) / "config.yaml" if run_dir is not None else None
    run_config = (f"{written}, the config `rft run` wrote" if written is not None and written.exists()
                  else "the config.yaml that `rft run` wrote to its run directory")
    return (f"{where} is 'embedded', a broker that only `rft run` starts, for the parts it runs; {part} joins a "
            f"running broker: pass {fix}, or {run_config} (it names its broker)")


def require_broker(cfg: Config, part: str) -> None:
    """The guard of every part that joins a run's broker (`rft trainer`, `rft explorer`, `rft publish`, `rft serve`,
    `rft joiner`, `rft status`, `rft replay`): when `kafka.bootstrap_servers` is `embedded`, print
    `embedded_broker_error` after the part's name and exit 2."""
    if cfg.kafka.bootstrap_servers == EMBEDDED:
        print(f"{part}: {embedded_broker_error(part, run_dir=cfg.run_dir)}", file=sys.stderr)
        raise SystemExit(2)


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
