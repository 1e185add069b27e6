"""`rft run CONFIG`: everything a run needs on one machine, as child processes, stopped together.

Starts, in order: the local broker (`kafka.bootstrap_servers: embedded`), the topics, the task publisher (every task
at once, or the online `publisher` part for a selector that reads rewards), the trainer under torchrun (TP x PP x DP
processes), `explorer.replicas` explorers, and the live run page when `monitor.dashboard_port` is set. Which parts
start follows `run.mode` (rft/modes.py); in `serve` mode `rft serve` and the joiner start beside the trainer (a
failed server ends the run; a dead joiner is reported and may be restarted with `rft joiner`).

Shutdown: when the trainer finishes, the explorers are stopped and the run ends with 0. When the trainer, the online
task publisher, or every explorer dies, everything is stopped and the run ends with 1, printing the failed part's
last log lines; a single explorer dying is tolerated while others remain. Ctrl-C and SIGTERM stop everything. Each
part's output goes to `<run dir>/logs/<part>.log`.
A config with `stages:` runs its stages in order in `<run dir>/stages/<run>.<stage>/`, on one broker; finished
stages (`stage_done.json`) are skipped on a re-run (rft/run/stages.py).

`run` is the recipe; each step lives beside it: prepare.py (run directory, config, topics), planning.py (GPUs and
cores), part_commands.py (what starts), parts.py (the processes), progress.py (watching the run, the reward curve).
"""
from __future__ import annotations

import argparse
import os
import sys

from rft.broker.local import KafkaEndpoint
from rft.cli.commandline import add_config_arguments, config_from_args
from rft.cli.part_commands import part_commands
from rft.cli.parts import STOP_REQUESTED, PartRunner, install_run_stop_signals
from rft.cli.planning import LaunchError, bf16_hint, core_board, cpu_threads_per_part, gpu_plan, visible_gpus
from rft.cli.prepare import endpoints_refused, make_private_dir, prepare_topics, write_run_config
from rft.cli.progress import plot_reward_curve, watch_run
from rft.data.selectors import selector_needs_rewards
from rft.modes import MODES
from rft.run.config import Config
from rft.run.stages import resolve_stages

ROLES_BY_MODE = {name: m.roles for name, m in MODES.items()}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="rft run", description=__doc__.split("\n")[0])
    add_config_arguments(parser)
    args = parser.parse_args(argv)
    os.umask(0o077)  # what the run and its parts create: directories 0700, files 0600 (they inherit it)
    return run_until_stopped(config_from_args(args, need_model=True))


def run_until_stopped(cfg: Config) -> int:
    """`run`, with SIGINT / SIGTERM stopping everything (exit 130) wherever they arrive. A stopped run's process
    ends right after its parts are stopped (they are, in `run`'s `finally`): a stop can land inside a library
    call (a Kafka client mid-request), and what that call leaves behind (its threads, its atexit hooks) must not
    keep a Ctrl-C'd `rft run` alive, as it once did for minutes at full CPU."""
    install_run_stop_signals()
    try:
        code = run(cfg)
    except KeyboardInterrupt:
        print("\n[rft] interrupted", flush=True)
        code = 130
    if STOP_REQUESTED.is_set():
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


def run(cfg: Config) -> int:
    """One run (or its stages): prepare, plan the machine, start the parts, watch them, finish (module docstring)."""
    if cfg.stages:
        return run_stages(cfg)
    roles = ROLES_BY_MODE[cfg.run.mode]
    refused = endpoints_refused(cfg, roles)
    if refused:
        print(f"[rft] {refused}", file=sys.stderr, flush=True)
        return 2
    run_dir = cfg.run_dir
    make_private_dir(run_dir / "logs")
    with KafkaEndpoint(cfg.kafka, log_path=run_dir / "logs" / "broker.log", run_dir=run_dir) as bootstrap:
        cfg = cfg.with_broker(bootstrap)
        config_path = run_dir / "config.yaml"
        write_run_config(cfg, config_path)
        print(f"[rft] run {cfg.run.name!r} mode {cfg.run.mode} -> {run_dir} (kafka {bootstrap})", flush=True)
        online = "explorers" in roles and selector_needs_rewards(cfg.data)  # publish as rewards come in
        if not prepare_topics(cfg, roles, online=online):
            return 2
        try:
            gpus = gpu_plan(cfg, roles, visible_gpus())
        except LaunchError as e:
            print(f"[rft] {e}", file=sys.stderr, flush=True)
            return 2
        threads = cpu_threads_per_part(cfg, roles, gpus)
        bf16_hint(cfg, gpus)
        runner = PartRunner(run_dir, threads=threads, cores=core_board(cfg, roles, threads, run_dir))
        try:
            for part in part_commands(cfg, config_path, roles, online=online):
                runner.start(part.name, part.argv, blocked_signals=part.blocked_signals, gpus=gpus.get(part.name))
            code = watch_run(cfg, runner, roles)
        except KeyboardInterrupt:
            print("\n[rft] interrupted: stopping every part", flush=True)
            code = 130
        finally:
            runner.stop_all()
        if code == 0 and "trainer" in roles:
            plot_reward_curve(cfg)
        return code


def run_stages(cfg: Config) -> int:
    """The stages of `cfg` in order, on one broker; a finished stage is skipped, a failed one ends the run."""
    make_private_dir(cfg.run_dir / "logs")
    with KafkaEndpoint(cfg.kafka, log_path=cfg.run_dir / "logs" / "broker.log",
                       run_dir=cfg.run_dir) as bootstrap:
        cfg = cfg.with_broker(bootstrap)
        write_run_config(cfg, cfg.run_dir / "config.yaml")
        stages = resolve_stages(cfg)
        for stage in stages:
            done = stage.done()
            if done and done.get("config_digest") != stage.digest():
                print(f"[rft] stage {stage.name!r} finished with another config than stages[{stage.index}] now "
                      f"describes: delete {stage.run_dir} to run it again, or restore its config", file=sys.stderr)
                return 2
            if done:
                print(f"[rft] stage {stage.name!r} is done ({stage.run_dir / 'stage_done.json'}): skipping it",
                      flush=True)
                continue
            later = [s.run_dir for s in stages[stage.index + 1:] if s.run_dir.exists()]
            if later:
                print(f"[rft] stage {stage.name!r} is not done but later stages ran ({', '.join(map(str, later))}); "
                      "they started from other weights: delete them to go on", file=sys.stderr)
                return 2
            print(f"[rft] stage {stage.index + 1}/{len(stages)} {stage.name!r} -> {stage.run_dir}", flush=True)
            code = run(stage.config)
            if code != 0:
                return code
            if STOP_REQUESTED.is_set():
                return 130
            if not stage.weights_out.is_dir():
                print(f"[rft] stage {stage.name!r} ended without final weights ({stage.weights_out}; did it train "
                      "any step?)", file=sys.stderr)
                return 1
            stage.mark_done()
    return 0
