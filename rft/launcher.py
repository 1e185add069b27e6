"""`rft run CONFIG`: everything a run needs on one machine, as child processes, stopped together.

Starts, in order: the local broker (when `kafka.bootstrap_servers: embedded`), the topics, the task publisher
(every task at once, or the online `publisher` part for a selector that reads rewards, see
rft/explorer/publisher.py), the trainer under torchrun (TP x PP x DP processes), and `explorer.replicas` explorers
(the weight-broadcast coordinator is a role of the trainer's publishing rank: see rft/trainer/main.py). Which parts
start follows `run.mode`: `explore` starts no trainer, `train` and `offline` no explorers. A failed `publisher`
ends the run like a failed trainer.

Shutdown: when the trainer finishes, the explorers are stopped and the run ends with 0. When the trainer dies,
or every explorer has died, everything is stopped and the run ends with 1, printing the failed part's last log
lines. A single explorer dying is reported and tolerated while others remain (fleets are elastic). Ctrl-C stops
everything. Each part's output goes to `<run dir>/logs/<part>.log`.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from rft.broker import KafkaEndpoint
from rft.cli import add_config_arguments, config_from_args
from rft.config import Config
from rft.explorer.selectors import selector_needs_rewards

ROLES_BY_MODE = {
    "sync": ("trainer", "explorers"), "off_policy": ("trainer", "explorers"), "async": ("trainer", "explorers"),
    "train": ("trainer",), "offline": ("trainer",), "explore": ("explorers",),
}


@dataclass
class Part:
    name: str
    process: subprocess.Popen
    log_path: Path


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="rft run", description=__doc__.split("\n")[0])
    add_config_arguments(parser)
    args = parser.parse_args(argv)
    cfg = config_from_args(args)
    return run(cfg)


def run(cfg: Config) -> int:
    run_dir = cfg.run_dir
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    with KafkaEndpoint(cfg.kafka, log_path=run_dir / "logs" / "broker.log") as bootstrap:
        cfg.kafka.bootstrap_servers = bootstrap
        config_path = run_dir / "config.yaml"
        config_path.write_text(cfg.to_yaml())
        print(f"[rft] run {cfg.run.name!r} mode {cfg.run.mode} -> {run_dir} (kafka {bootstrap})", flush=True)
        _create_topics(cfg)
        roles = ROLES_BY_MODE[cfg.run.mode]
        online = "explorers" in roles and selector_needs_rewards(cfg.data)  # publish as rewards come in
        if "explorers" in roles and not online:
            _publish_tasks(cfg)
        runner = PartRunner(run_dir)
        try:
            if online:
                runner.start("publisher", [sys.executable, "-m", "rft.cli", "publish", str(config_path)])
            if "trainer" in roles:
                runner.start("trainer", _trainer_command(cfg, config_path))
            if "explorers" in roles:
                for i in range(cfg.explorer.replicas):
                    runner.start(f"explorer-{i}", [sys.executable, "-m", "rft.cli", "explorer", str(config_path),
                                                   "--explorer-id", f"explorer-{i}"])
            progress = MetricsProgress(run_dir / "metrics.jsonl", cfg.run.max_steps) if cfg.monitor.progress else None
            code = runner.supervise(main_part="trainer" if "trainer" in roles else None, on_tick=progress,
                                    essential={"publisher"})
        except KeyboardInterrupt:
            print("\n[rft] interrupted: stopping every part", flush=True)
            code = 130
        finally:
            runner.stop_all()
        if code == 0 and "trainer" in roles:
            _plot(cfg)
        return code


def _create_topics(cfg: Config) -> None:
    from rft.transport import Admin

    admin = Admin(cfg.kafka, cfg.kafka.bootstrap_servers)
    try:
        admin.create_topics([cfg.topic("tasks"), cfg.topic("control"), cfg.topic("dead_letter")])
        admin.create_topics([cfg.topic("experiences")], partitions=cfg.kafka.experience_partitions)
    finally:
        admin.close()


def _publish_tasks(cfg: Config) -> None:
    """Publish the task set, unless the tasks topic already holds tasks (a resumed run on a durable broker)."""
    from rft.explorer.tasks import publish_tasks
    from rft.transport import RecordSource

    source = RecordSource(cfg.kafka, cfg.kafka.bootstrap_servers)
    try:
        existing = sum(source.end_offsets(cfg.topic("tasks")).values())
    finally:
        source.close()
    if existing:
        print(f"[rft] {cfg.topic('tasks')} already holds {existing} tasks: not publishing again", flush=True)
        return
    count = publish_tasks(cfg)
    print(f"[rft] published {count} tasks to {cfg.topic('tasks')}", flush=True)


def _trainer_command(cfg: Config, config_path: Path) -> list[str]:
    t = cfg.trainer
    nproc = t.tensor_parallel * t.pipeline_parallel * t.data_parallel
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
            "-m", "rft.cli", "trainer", str(config_path)]


def _plot(cfg: Config) -> None:
    from rft.monitor import plot_rewards

    metrics = cfg.run_dir / "metrics.jsonl"
    if metrics.exists():
        png = plot_rewards(metrics, cfg.run_dir / "reward.png", title=cfg.run.name)
        print(f"[rft] reward curve: {png}", flush=True)


class PartRunner:
    """Child processes of a run, each in its own process group, each logging to its own file."""

    def __init__(self, run_dir: Path):
        self.run_dir = run_dir
        self.parts: dict[str, Part] = {}

    def start(self, name: str, command: list[str]) -> None:
        log_path = self.run_dir / "logs" / f"{name}.log"
        log = open(log_path, "ab")
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        self.parts[name] = Part(name, process, log_path)
        print(f"[rft] started {name} (pid {process.pid}, log {log_path})", flush=True)

    def supervise(self, main_part: str | None, *, on_tick=None, poll_s: float = 0.5,
                  essential: set[str] = frozenset()) -> int:
        """Wait for the main part; `essential` parts end the run (with 1) when they fail, others are tolerated."""
        reported: set[str] = set()
        while True:
            if on_tick is not None:
                on_tick()
            for part in list(self.parts.values()):
                code = part.process.poll()
                if code is None or part.name in reported:
                    continue
                reported.add(part.name)
                if part.name == main_part:
                    if code == 0:
                        print(f"[rft] {part.name} finished", flush=True)
                        return 0
                    self._report_failure(part, code)
                    return 1
                if code != 0:
                    self._report_failure(part, code)
                    if part.name in essential:
                        return 1
            explorers = [p for p in self.parts.values() if p.name.startswith("explorer")]
            if explorers and all(p.process.poll() is not None for p in explorers):
                if main_part is None:
                    return 0 if all(p.process.returncode == 0 for p in explorers) else 1
                print("[rft] every explorer has stopped: stopping the run", flush=True)
                return 1
            time.sleep(poll_s)

    def _report_failure(self, part: Part, code: int) -> None:
        tail = part.log_path.read_text(errors="replace").splitlines()[-25:]
        print(f"[rft] {part.name} exited with code {code}; last lines of {part.log_path}:", file=sys.stderr)
        for line in tail:
            print(f"    {line}", file=sys.stderr)
        sys.stderr.flush()

    def stop_all(self, grace_s: float = 15.0) -> None:
        alive = [p for p in self.parts.values() if p.process.poll() is None]
        for part in alive:
            _signal_group(part.process, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for part in alive:
            try:
                part.process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _signal_group(part.process, signal.SIGKILL)
                part.process.wait()


class MetricsProgress:
    """Prints one console line per trainer step as metrics.jsonl grows (the trainer's own log has more)."""

    def __init__(self, path: Path, max_steps: int):
        self.path, self.max_steps, self.offset = path, max_steps, 0
        self.started = time.time()

    def __call__(self) -> None:
        if not self.path.exists():
            return
        with open(self.path) as f:
            f.seek(self.offset)
            lines = f.readlines()
            if lines and not lines[-1].endswith("\n"):
                lines.pop()  # a line still being written
            self.offset += sum(len(line) for line in lines)
        for line in lines:
            m = json.loads(line)
            print(f"[rft] step {m['step']:>4}/{self.max_steps}  reward {m.get('reward_mean', float('nan')):.3f}  "
                  f"loss {m.get('loss', float('nan')):+.4f}  staleness max {m.get('staleness_max', 0)}  "
                  f"dropped {m.get('dropped_stale', 0)}  {time.time() - self.started:6.0f} s", flush=True)


def _signal_group(process: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(process.pid, sig)
    except ProcessLookupError:
        pass


def replay_main(argv: list[str]) -> int:
    """`rft replay CONFIG [--from X] [--to Y]`: offline training from a recorded experiences topic."""
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
    cfg = config_from_args(args)
    if cfg.kafka.bootstrap_servers == "embedded":
        print("rft replay: replay reads an existing topic: set kafka.bootstrap_servers to the broker that holds it",
              file=sys.stderr)
        return 2
    from rft.algorithms import build_algorithm

    if not build_algorithm(cfg.algorithm).supports_replay:
        print(f"rft replay: algorithm {cfg.algorithm.name!r} cannot train on recorded experiences as configured "
              "(use sft, dpo, or a policy-gradient algorithm with algorithm.off_policy_correction: true)",
              file=sys.stderr)
        return 2
    return run(cfg)
