"""`rft explorer CONFIG`: one explorer in this process, or `--replicas N` explorer processes
(rft/explorer/replicas.py). `build_explorer` composes an `Explorer` (rft/explorer/explorer.py, where the explorer's
parts, its control messages and its metrics are described) from the root config; `build_admission` its admission.
"""
from __future__ import annotations

import argparse
import logging
import os
import socket
import sys
import threading
from typing import TYPE_CHECKING

from rft.config import Config
from rft.engine import build_engine
from rft.explorer.admission import Admission, AdmitAll, fleet_admission
from rft.explorer.explorer import Explorer
from rft.explorer.replicas import run_replicas
from rft.modes import mode
from rft.registry import import_object
from rft.rewards import RewardContext, build_reward
from rft.run.commandline import add_config_arguments, config_from_args, install_stop_signals
from rft.run.monitor import metrics_endpoint
from rft.transport import Transport, connect, probe_bootstrap
from rft.transport.run_topics import RunTopics
from rft.weights.stores import open_store
from rft.workflows import build_workflow

if TYPE_CHECKING:
    from rft.engine import Engine
    from rft.workflows import Workflow

log = logging.getLogger("rft.explorer")


# --------------------------------------------------------------------------------------------------
# Command line


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="rft explorer", description="Explorers: join a run's tasks topic and "
                                     "produce experience groups.")
    add_config_arguments(parser)
    parser.add_argument("--replicas", type=int, default=None,
                        help="start N explorer processes (default: 1, in this process)")
    parser.add_argument("--explorer-id", default=None, help="this explorer's id (default: HOST-PID); "
                        "with --replicas, the prefix of the replicas' ids")
    parser.add_argument("--exit-when-idle", type=float, default=None, metavar="SECONDS",
                        help="exit 0 after this long without tasks (explore-only runs over a finite dataset; "
                             "default: explorer.exit_when_idle_s)")
    return parser.parse_args(argv)


def main(argv: list[str]) -> int:
    args = _parse(argv)
    cfg = config_from_args(args, joins_broker="rft explorer")
    if not mode(cfg.run.mode).explorers:
        print(f"rft explorer: run.mode {cfg.run.mode} runs no explorers", file=sys.stderr)
        return 2
    if args.replicas is not None and args.replicas < 1:
        print(f"rft explorer: --replicas must be >= 1, got {args.replicas}", file=sys.stderr)
        return 2
    probe_bootstrap(cfg.kafka.bootstrap_servers)  # BrokerUnreachable (exit 4) before minutes of engine start-up
    if args.replicas is not None and args.replicas != 1:
        return run_replicas(args, args.replicas)
    return run_one(cfg, explorer_id=args.explorer_id or f"{socket.gethostname()}-{os.getpid()}",
                   exit_when_idle_s=args.exit_when_idle if args.exit_when_idle is not None
                   else cfg.explorer.exit_when_idle_s or None)


def run_one(cfg: Config, *, explorer_id: str, exit_when_idle_s: float | None = None) -> int:
    """Build the engine, reward and workflow, then explore until SIGTERM / Ctrl-C (or idle)."""
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {explorer_id} %(levelname)s %(message)s")
    logging.getLogger("kafka").setLevel(logging.WARNING)
    stop = threading.Event()
    install_stop_signals(stop)
    from rft.weights.vllm_transfer import push_transport  # heavy: torch

    engine = build_engine(cfg.explorer, cfg.model, seed=cfg.run.seed,
                          weight_transfer=push_transport(cfg.sync, cfg.explorer,
                                                         lora=cfg.model.lora.rank > 0) == "vllm",
                          record_routing=cfg.trainer.routing_replay)  # what the trainer replays
    explorer = None
    reason = "error"
    try:
        workflow = build_workflow(cfg.explorer, cfg.model, build_reward(cfg.explorer, RewardContext.for_run(cfg)))
        transport = connect(cfg.kafka)  # this process's one client factory
        explorer = build_explorer(cfg, explorer_id=explorer_id, engine=engine, workflow=workflow,
                                  admission=build_admission(cfg, explorer_id, transport=transport),
                                  transport=transport)
        reason = explorer.run(stop, exit_when_idle_s=exit_when_idle_s)
        log.info("explorer %s %s after %d groups", explorer_id, reason, explorer.stats.groups)
        return 0
    finally:
        if explorer is not None:
            explorer.close(reason)
        engine.close()


def build_explorer(cfg: Config, *, explorer_id: str, engine: "Engine", workflow: "Workflow",
                   admission: Admission | None = None, transport: Transport | None = None) -> Explorer:
    """Compose an Explorer from the root config: its sections, the run's topics and weight store, the metrics
    endpoint `monitor.prometheus_port` asks for; `transport` defaults to `connect(cfg.kafka)`."""
    return Explorer(cfg.explorer, kafka=cfg.kafka, sync=cfg.sync, topics=RunTopics.of(cfg),
                    store=open_store(cfg.sync, cfg.run_dir), explorer_id=explorer_id, engine=engine,
                    workflow=workflow, admission=admission, transport=transport,
                    prometheus=metrics_endpoint(cfg.monitor, run=cfg.run.name, role="explorer", instance=explorer_id))


def build_admission(cfg: Config, explorer_id: str, *, transport: Transport | None = None) -> Admission:
    """`explorer.admission`: `staleness` (the run mode's bound, fleet-wide: rft/explorer/admission.py; read through
    `transport`, default `connect(cfg.kafka)`), `all`, or `package.module:factory` called as
    factory(cfg, explorer_id)."""
    if cfg.explorer.admission == "all":
        return AdmitAll()
    if cfg.explorer.admission == "staleness":
        return fleet_admission(cfg.run.mode, max_staleness=cfg.run.max_staleness,
                               groups_per_step=cfg.trainer.groups_per_step, transport=transport or connect(cfg.kafka),
                               control_topic=cfg.topic("control"), experiences_topic=cfg.topic("experiences"),
                               explorer_id=explorer_id, heartbeat_s=cfg.explorer.heartbeat_s)
    return import_object(cfg.explorer.admission, key="explorer.admission", noun="admission")(cfg, explorer_id)
