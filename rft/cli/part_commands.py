"""Which parts `rft run` starts, in order, and the command line of each (`part_commands`): the live run page
(`rft dashboard`, with monitor.dashboard_port), the online task `publisher` (a selector that reads rewards), the
trainer under torchrun (TP x PP x DP processes; rft/cli/torchrun.py keeps its stores on localhost), the explorers
(`explorer.replicas`; in explore mode each exits once the task set is exhausted), serve mode's `rft serve` and
joiner, and the periodic evaluator (`eval.every_steps`). Which of them a run has follows `run.mode` (its roles).
Every part reads the config `rft run` wrote (`config_path`).
"""
from __future__ import annotations

import signal
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from rft.cli.parts import DASHBOARD, EVALUATOR, JOINER, SERVER
from rft.modes import mode
from rft.run.config import Config

EXPLORE_IDLE_EXIT_S = 30.0


@dataclass(frozen=True)
class PartCommand:
    """One part to start: its name (its log is `logs/<name>.log`), its command line, and the signals it starts with
    blocked (PartRunner.start)."""
    name: str
    argv: list[str]
    blocked_signals: tuple[int, ...] = ()


def part_commands(cfg: Config, config_path: Path, roles: tuple[str, ...], *, online: bool) -> Iterator[PartCommand]:
    """The parts of this run in start order (module docstring); `online`: the tasks are published by the `publisher`
    part. A generator: the evaluator's note (when the mode publishes no weights to evaluate) is printed when its turn
    comes, after the parts before it started."""
    config = str(config_path)

    def rft(*args: str) -> list[str]:
        return [sys.executable, "-m", "rft.cli", *args]

    if cfg.monitor.dashboard_port:
        yield PartCommand(DASHBOARD, rft("dashboard", config, "--port", str(cfg.monitor.dashboard_port)))
    if online:
        yield PartCommand("publisher", rft("publish", config))
    if "trainer" in roles:
        yield PartCommand("trainer", trainer_command(cfg, config_path))
    if "explorers" in roles:
        for i in range(cfg.explorer.replicas):
            yield PartCommand(f"explorer-{i}", rft("explorer", config, "--explorer-id", f"explorer-{i}",
                                                   *explore_only_exit(cfg)))
    if "serve" in roles:  # serve mode: the endpoint and the joiner (rft/serve/)
        yield PartCommand(SERVER, rft("serve", config))
        yield PartCommand(JOINER, rft("joiner", config))
    if evaluates(cfg, roles):  # SIGUSR1 blocked until it can take `finish` (PartRunner)
        yield PartCommand(EVALUATOR, rft("eval", config, "--follow"), blocked_signals=(signal.SIGUSR1,))


def evaluates(cfg: Config, roles: tuple[str, ...]) -> bool:
    """Periodic evaluation (`eval.every_steps`): `rft eval --follow` beside the trainer, reading the weight store
    (see rft/evaluation/main.py); it never blocks training. An offline replay publishes no weights: a note, no
    evaluator."""
    if not cfg.eval.every_steps or "trainer" not in roles:
        return False
    if not mode(cfg.run.mode).publishes_weights:
        print("[rft] eval.every_steps: an offline replay publishes no weights to evaluate; use `rft eval "
              "--checkpoint` on its final weights", flush=True)
        return False
    return True


def trainer_command(cfg: Config, config_path: Path) -> list[str]:
    """The trainer's ranks under torchrun whose stores listen on localhost only (rft/cli/torchrun.py)."""
    t = cfg.trainer
    nproc = t.tensor_parallel * t.pipeline_parallel * t.data_parallel
    return [sys.executable, "-m", "rft.cli.torchrun", "--standalone", f"--nproc-per-node={nproc}",
            "-m", "rft.cli", "trainer", str(config_path)]


def explore_only_exit(cfg: Config) -> list[str]:
    """In explore mode nothing else ends the run: explorers exit once the task set is exhausted."""
    if mode(cfg.run.mode).trainer:
        return []
    return ["--exit-when-idle", str(cfg.explorer.exit_when_idle_s or EXPLORE_IDLE_EXIT_S)]
