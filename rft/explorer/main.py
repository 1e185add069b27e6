"""`rft explorer CONFIG`: one explorer in this process, or `--replicas N` explorer processes
(rft/explorer/replicas.py); `rft explorer A.yaml B.yaml ...`: one explorer serving several LoRA runs of one base
with one engine (rft/explorer/multirun.py). `compose_explorer` builds an `Explorer` (rft/explorer/explorer.py, where
the explorer's parts, its control messages and its metrics are described) of one run on a given engine;
`build_explorer` composes it from the root config, `build_admission` its admission.
"""
from __future__ import annotations

import argparse
import logging
import os
import socket
import sys
import threading
from typing import TYPE_CHECKING

from rft.cli.commandline import add_config_arguments, config_from_args, install_stop_signals
from rft.config import ConfigError
from rft.cores import CoreShare
from rft.engine import EngineError, VLLMEngine, build_engine
from rft.engine.paced import paced
from rft.engine.shared import adapter_slots
from rft.explorer.admission import Admission, AdmitAll, checked, fleet_admission
from rft.explorer.explorer import Explorer
from rft.explorer.multirun import SharedRun, check_runs, engine_sections, run_explorers
from rft.explorer.replicas import run_replicas
from rft.modes import mode
from rft.observability.prometheus import metrics_endpoint
from rft.registry import import_object
from rft.rewards import RewardContext, build_reward
from rft.run.config import Config
from rft.run.records import run_transport
from rft.schema import ImageLimits, RewardRange
from rft.transport import Transport, probe_bootstrap
from rft.transport.run_topics import RunTopics
from rft.weights.store import store_root
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
    parser.add_argument("more_configs", nargs="*", metavar="CONFIG",
                        help="other runs of the same base model, each training LoRA: this explorer serves them all "
                             "with one engine, each run with its own adapter (docs/lora.md); --set applies to each")
    parser.add_argument("--replicas", type=int, default=None,
                        help="start N explorer processes (default: 1, in this process)")
    parser.add_argument("--explorer-id", default=None, help="this explorer's id (default: HOST-PID); "
                        "with --replicas, the prefix of the replicas' ids")
    parser.add_argument("--exit-when-idle", type=float, default=None, metavar="SECONDS",
                        help="exit 0 after this long without tasks (explore-only runs over a finite dataset; "
                             "default: explorer.exit_when_idle_s)")
    return parser.parse_intermixed_args(argv)  # the configs may come before or after the options


def main(argv: list[str]) -> int:
    args = _parse(argv)
    paths = [args.config, *args.more_configs]
    cfgs = [config_from_args(argparse.Namespace(config=p, overrides=args.overrides), joins_broker="rft explorer")
            for p in paths]
    if not mode(cfgs[0].run.mode).explorers:
        print(f"rft explorer: run.mode {cfgs[0].run.mode} runs no explorers", file=sys.stderr)
        return 2
    if len(cfgs) > 1:
        try:
            check_runs([shared_run(path, cfg) for path, cfg in zip(paths, cfgs, strict=True)])
        except ConfigError as e:
            print(f"rft explorer: invalid config: {e}", file=sys.stderr)
            return 2
    if args.replicas is not None and args.replicas < 1:
        print(f"rft explorer: --replicas must be >= 1, got {args.replicas}", file=sys.stderr)
        return 2
    for cfg in cfgs:
        probe_bootstrap(cfg.kafka.bootstrap_servers)  # BrokerUnreachable (exit 4) before minutes of engine start-up
    if args.replicas is not None and args.replicas != 1:
        return run_replicas(args, args.replicas)
    explorer_id = args.explorer_id or f"{socket.gethostname()}-{os.getpid()}"
    idle_s = [args.exit_when_idle if args.exit_when_idle is not None else cfg.explorer.exit_when_idle_s or None
              for cfg in cfgs]
    if len(cfgs) > 1:
        return run_shared(cfgs, explorer_id=explorer_id, exit_when_idle_s=idle_s)
    return run_one(cfgs[0], explorer_id=explorer_id, exit_when_idle_s=idle_s[0])


def run_one(cfg: Config, *, explorer_id: str, exit_when_idle_s: float | None = None) -> int:
    """Build the engine, reward and workflow, then explore until SIGTERM / Ctrl-C (or idle)."""
    stop = _start_process(explorer_id)
    from rft.weights.vllm_transfer import push_transport  # heavy: torch

    cores = CoreShare.from_environment()  # a CPU run's core board (rft/cores.py); None with GPUs
    engine = build_engine(cfg.explorer, cfg.model, seed=cfg.run.seed,
                          weight_transfer=push_transport(cfg.sync, cfg.explorer,
                                                         lora=cfg.model.lora.rank > 0) == "vllm",
                          record_routing=cfg.run.routing_replay,  # what the trainer replays
                          routing_prefill=cfg.run.routing_prefill,
                          elastic_threads=cores is not None)
    explorer = None
    reason = "error"
    try:
        explorer = compose_explorer(cfg, explorer_id=explorer_id, engine=engine, cores=cores)
        reason = explorer.run(stop, exit_when_idle_s=exit_when_idle_s)
        log.info("explorer %s %s after %d groups", explorer_id, reason, explorer.stats.groups)
        return 0
    finally:
        if explorer is not None:
            explorer.close(reason)
        engine.close()


def run_shared(cfgs: list[Config], *, explorer_id: str, exit_when_idle_s: list[float | None]) -> int:
    """One engine with LoRA for every run of `cfgs` (checked by `check_runs`), one `AdapterSlot` and one explorer
    per run on it; explore until SIGTERM / Ctrl-C (or each run idle): rft/explorer/multirun.py."""
    stop = _start_process(explorer_id, thread=True)
    section, model = engine_sections([shared_run("", cfg) for cfg in cfgs])
    engine = build_engine(section, model, seed=cfgs[0].run.seed, max_loras=len(cfgs),
                          record_routing=cfgs[0].run.routing_replay, routing_prefill=cfgs[0].run.routing_prefill)
    if not isinstance(engine, VLLMEngine):  # build_engine's engine for several adapters
        raise EngineError(f"several runs in one engine need a VLLMEngine, got {type(engine).__name__}")
    try:
        slots = adapter_slots(engine, [cfg.run.name for cfg in cfgs])
        for cfg, slot in zip(cfgs, slots, strict=True):
            if cfg.model.lora.init_from:  # the run's version 0: the base and its starting adapter
                slot.load_weights(cfg.model.lora.init_from, 0)
        explorers = [compose_explorer(cfg, explorer_id=explorer_id, engine=slot)
                     for cfg, slot in zip(cfgs, slots, strict=True)]
        run_explorers(explorers, stop, exit_when_idle_s)
        return 0
    finally:
        engine.close()


def shared_run(source: str, cfg: Config) -> SharedRun:
    """The sections of `cfg` (read from `source`) that decide whether it may share an engine (multirun.py)."""
    return SharedRun(source=source, run=cfg.run, model=cfg.model, explorer=cfg.explorer, sync=cfg.sync,
                     kafka=cfg.kafka, store=str(store_root(cfg.sync, cfg.run_dir)))


def _start_process(explorer_id: str, *, thread: bool = False) -> threading.Event:
    """Logging (each line with the explorer id, and the thread: a run's name, when `thread`) and the stop event
    SIGTERM / Ctrl-C set."""
    where = f"{explorer_id} %(threadName)s" if thread else explorer_id
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {where} %(levelname)s %(message)s")
    logging.getLogger("kafka").setLevel(logging.WARNING)
    stop = threading.Event()
    install_stop_signals(stop)
    return stop


def compose_explorer(cfg: Config, *, explorer_id: str, engine: Engine, cores: CoreShare | None = None) -> Explorer:
    """Run `cfg`'s explorer on `engine`: its workflow and reward, its Kafka clients (one client factory), its
    admission and metrics endpoint; `cores`: the engine's place on a CPU run's core board (rft/cores.py): the engine
    and workflow are paced on it (rft/engine/paced.py; one explorer per process, so not for a shared engine)."""
    workflow = build_workflow(cfg.explorer, cfg.model, build_reward(cfg.explorer, RewardContext.for_run(cfg)))
    if cores is not None:
        engine, workflow = paced(engine, workflow, cores)
    transport = run_transport(cfg)
    return build_explorer(cfg, explorer_id=explorer_id, engine=engine, workflow=workflow,
                          admission=build_admission(cfg, explorer_id, transport=transport), transport=transport)


def build_explorer(cfg: Config, *, explorer_id: str, engine: Engine, workflow: Workflow,
                   admission: Admission | None = None, transport: Transport | None = None) -> Explorer:
    """Compose an Explorer from the root config: its sections, the run's topics and weight store, the metrics
    endpoint `monitor.prometheus_port` asks for; `transport` defaults to `run_transport(cfg)` (the run's Kafka, with
    its claim store)."""
    return Explorer(cfg.explorer, kafka=cfg.kafka, sync=cfg.sync, topics=RunTopics.of(cfg),
                    rewards=RewardRange.of(cfg.run), images=ImageLimits.of(cfg.data),
                    store=open_store(cfg.sync, cfg.run_dir), explorer_id=explorer_id,
                    engine=engine, workflow=workflow, admission=admission, transport=transport or run_transport(cfg),
                    prometheus=metrics_endpoint(cfg.monitor, run=cfg.run.name, role="explorer", instance=explorer_id))


def build_admission(cfg: Config, explorer_id: str, *, transport: Transport | None = None) -> Admission:
    """`explorer.admission`: `staleness` (the run mode's bound, fleet-wide: rft/explorer/admission.py; read through
    `transport`, default `run_transport(cfg)`), `all`, or `package.module:factory` called as
    factory(cfg, explorer_id), whose result must have every method of `Admission` (ConfigError otherwise)."""
    if cfg.explorer.admission == "all":
        return AdmitAll()
    if cfg.explorer.admission == "staleness":
        return fleet_admission(cfg.run.mode, max_staleness=cfg.run.max_staleness,
                               groups_per_step=cfg.run.groups_per_step, transport=transport or run_transport(cfg),
                               control_topic=cfg.topic("control"), experiences_topic=cfg.topic("experiences"),
                               explorer_id=explorer_id, heartbeat_s=cfg.explorer.heartbeat_s,
                               counts_drops=cfg.explorer.admission_counts_drops,
                               async_max_staleness=cfg.run.async_max_staleness)
    factory = import_object(cfg.explorer.admission, key="explorer.admission", noun="admission")
    return checked(factory(cfg, explorer_id), key="explorer.admission")
