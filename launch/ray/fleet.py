"""Explorer fleets on a Ray cluster: one small actor per explorer, each supervising an `rft explorer` process
on its node. Ray places the actors (CPUs / GPUs per explorer); Kafka's consumer group spreads the tasks.

    python -m launch.ray.fleet CONFIG --replicas N [--address ADDR] [--set k=v ...]
        start N explorers and keep them running until Ctrl-C or SIGTERM (then stop them all)
    python -m launch.ray.fleet scale RUN N [--address ADDR]     resize the live fleet of run RUN to N
    python -m launch.ray.fleet status RUN [--address ADDR]      one line per explorer
    python -m launch.ray.fleet stop RUN [--address ADDR]        stop every explorer of the fleet

The fleet is a named actor (`rft-fleet-<run>` in namespace `rft`) owned by the first command, so the
other commands reach it from any machine of the cluster. The resolved config travels as YAML text: nodes
need the model and the weight store (shared filesystem), not the config file. Growing starts explorers
that load the newest weights before their first group; shrinking stops the newest explorers with SIGTERM
(each finishes its batch, commits and leaves the consumer group), SIGKILL after `grace_s`.
"""
from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rft.extras import require

ray = require("ray", feature="launch.ray.fleet")  # the 'ray' extra: MissingExtra names the pip command

NAMESPACE = "rft"
COMMANDS = ("scale", "status", "stop")


def fleet_name(run: str) -> str:
    return f"rft-fleet-{run}"


@ray.remote
class ExplorerActor:
    """Supervises one `rft explorer` process on this actor's node."""

    def __init__(self, config_yaml: str, explorer_id: str, log_dir: str | None = None):
        self.explorer_id = explorer_id
        workdir = Path(tempfile.mkdtemp(prefix=f"rft-{explorer_id}-"))
        config_path = workdir / "config.yaml"
        config_path.write_text(config_yaml)
        self.log_path = Path(log_dir or workdir) / f"{explorer_id}.log"
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "rft.cli", "explorer", str(config_path), "--explorer-id", explorer_id],
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                env=dict(os.environ, PYTHONUNBUFFERED="1"))

    def status(self) -> dict:
        return {"explorer_id": self.explorer_id, "pid": self.process.pid, "returncode": self.process.poll(),
                "node": ray.get_runtime_context().get_node_id(), "log": str(self.log_path)}

    def stop(self, grace_s: float = 30.0) -> int:
        """SIGTERM the explorer (it finishes its batch and leaves), SIGKILL its process group after grace_s."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        return self.process.returncode


@ray.remote(num_cpus=0)
class Fleet:
    """The explorers of one run. Not meant to be called concurrently from several drivers for the same change."""

    def __init__(self, config_yaml: str, run: str, *, cpus_per_explorer: float = 1.0,
                 gpus_per_explorer: float = 0.0, log_dir: str | None = None):
        self.config_yaml, self.run, self.log_dir = config_yaml, run, log_dir
        self.options = {"num_cpus": cpus_per_explorer, "num_gpus": gpus_per_explorer}
        self.members: list[tuple[str, ray.actor.ActorHandle]] = []
        self.started = 0

    def scale(self, replicas: int, grace_s: float = 30.0) -> list[str]:
        """Grow or shrink to `replicas` explorers; returns the ids of the running ones."""
        if replicas < 0:
            raise ValueError(f"replicas must be >= 0, got {replicas}")
        while len(self.members) < replicas:
            explorer_id = f"{self.run}-ray-{self.started}"
            self.started += 1
            actor = ExplorerActor.options(**self.options).remote(self.config_yaml, explorer_id, self.log_dir)
            self.members.append((explorer_id, actor))
        surplus, self.members = self.members[replicas:], self.members[:replicas]
        ray.get([actor.stop.remote(grace_s) for _, actor in surplus])
        for _, actor in surplus:
            ray.kill(actor)
        return [explorer_id for explorer_id, _ in self.members]

    def status(self) -> list[dict]:
        return ray.get([actor.status.remote() for _, actor in self.members])

    def stop(self, grace_s: float = 30.0) -> None:
        self.scale(0, grace_s)


def start_fleet(config_yaml: str, run: str, replicas: int, *, detached: bool = False,
                **options) -> ray.actor.ActorHandle:
    """Create the named fleet of `run` and scale it to `replicas` (ray must be initialised)."""
    lifetime = {"lifetime": "detached"} if detached else {}
    fleet = Fleet.options(name=fleet_name(run), namespace=NAMESPACE, **lifetime).remote(config_yaml, run, **options)
    ray.get(fleet.scale.remote(replicas))
    return fleet


def get_fleet(run: str) -> ray.actor.ActorHandle:
    try:
        return ray.get_actor(fleet_name(run), namespace=NAMESPACE)
    except ValueError:
        raise SystemExit(f"no explorer fleet for run {run!r} on this Ray cluster") from None


# --------------------------------------------------------------------------------------------------
# Command line


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in COMMANDS:
        return _manage(argv)
    return _run_foreground(argv)


def _run_foreground(argv: list[str]) -> int:
    from rft.cli.commandline import add_config_arguments, config_from_args

    parser = argparse.ArgumentParser(prog="python -m launch.ray.fleet", description=__doc__.split("\n")[0])
    add_config_arguments(parser)
    parser.add_argument("--replicas", type=int, default=None, help="explorers to start (default explorer.replicas)")
    parser.add_argument("--address", default=None, help="Ray cluster address (default: start a local one)")
    parser.add_argument("--cpus-per-explorer", type=float, default=1.0)
    parser.add_argument("--gpus-per-explorer", type=float, default=None,
                        help="default: explorer.tensor_parallel_size when the cluster has GPUs, else 0")
    parser.add_argument("--log-dir", default=None, help="explorer logs (default <run dir>/logs on each node)")
    args = parser.parse_args(argv)
    cfg = config_from_args(args)
    if cfg.kafka.bootstrap_servers == "embedded":
        print("launch.ray.fleet: kafka.bootstrap_servers must name the run's broker, not 'embedded'", file=sys.stderr)
        return 2
    ray.init(address=args.address, namespace=NAMESPACE)
    gpus = args.gpus_per_explorer
    if gpus is None:
        gpus = float(cfg.explorer.tensor_parallel_size) if ray.cluster_resources().get("GPU", 0) else 0.0
    replicas = cfg.explorer.replicas if args.replicas is None else args.replicas
    fleet = start_fleet(cfg.to_yaml(), cfg.run.name, replicas, cpus_per_explorer=args.cpus_per_explorer,
                        gpus_per_explorer=gpus, log_dir=args.log_dir or str(Path(cfg.run_dir).resolve() / "logs"))
    print(f"explorer fleet {fleet_name(cfg.run.name)}: {replicas} explorers; Ctrl-C stops them", flush=True)
    stop = {"now": False}
    signal.signal(signal.SIGTERM, lambda *_: stop.update(now=True))
    try:
        while not stop["now"]:
            time.sleep(1.0)
    except KeyboardInterrupt:
        pass
    ray.get(fleet.stop.remote())
    return 0


def _manage(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m launch.ray.fleet", description="Manage a live explorer fleet.")
    parser.add_argument("command", choices=COMMANDS)
    parser.add_argument("run", help="run name (run.name of its config)")
    parser.add_argument("replicas", type=int, nargs="?", help="for scale: the new number of explorers")
    parser.add_argument("--address", default="auto")
    args = parser.parse_args(argv)
    if args.command == "scale" and args.replicas is None:
        parser.error("scale needs the number of explorers")
    ray.init(address=args.address, namespace=NAMESPACE)
    fleet = get_fleet(args.run)
    if args.command == "scale":
        print("running:", ", ".join(ray.get(fleet.scale.remote(args.replicas))) or "none")
    elif args.command == "status":
        for s in ray.get(fleet.status.remote()):
            state = "running" if s["returncode"] is None else f"exited {s['returncode']}"
            print(f"{s['explorer_id']}  {state}  pid {s['pid']}  node {s['node'][:12]}  log {s['log']}")
    else:
        ray.get(fleet.stop.remote())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
