"""`rft run CONFIG`: everything a run needs on one machine, as child processes, stopped together.

Starts, in order: the local broker (when `kafka.bootstrap_servers: embedded`), the topics, the task publisher
(every task at once, or the online `publisher` part for a selector that reads rewards, see
rft/explorer/publisher.py), the trainer under torchrun (TP x PP x DP processes), and `explorer.replicas` explorers
(the weight-broadcast coordinator is a role of the trainer's publishing rank: see rft/trainer/main.py), and the live
run page (`rft dashboard`) when `monitor.dashboard_port` is set. Which parts
start follows `run.mode`: `explore` starts no trainer, `train` and `offline` no explorers. A failed `publisher`
ends the run like a failed trainer. In `serve` mode `rft serve` and the joiner start beside the trainer (a failed
server ends the run; a joiner that dies is reported, and may be started again with `rft joiner`).

Shutdown: when the trainer finishes, the explorers are stopped and the run ends with 0. When the trainer dies,
or every explorer has died, everything is stopped and the run ends with 1, printing the failed part's last log
lines. A single explorer dying is reported and tolerated while others remain (fleets are elastic). Ctrl-C stops
everything, as does SIGTERM. Each part's output goes to `<run dir>/logs/<part>.log`.

A config with `stages:` runs its stages in order, each as above in `<run dir>/stages/<run>.<stage>/`, on one
broker; finished stages (`stage_done.json`) are skipped on a re-run (see rft/run/stages.py).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from rft.algorithms import REPLAY_HINT, build_algorithm
from rft.broker.local import KafkaEndpoint
from rft.config import REDACTED, Config, secret_values
from rft.cores import CoreShare, native_bf16_flags, write_board
from rft.data.demonstrations import prompt_tools, publish_demonstrations
from rft.data.selectors import selector_needs_rewards
from rft.data.tasks import DatasetError, build_picker, publish_tasks, published_groups
from rft.explorer.membership import fresh_group_for_restart
from rft.modes import MODES, mode
from rft.ops.status import StallWatch
from rft.processes import signal_group
from rft.cli.commandline import add_config_arguments, config_from_args, require_broker
from rft.observability.plots import plot_rewards
from rft.run.stages import resolve_stages
from rft.transport import connect
from rft.transport.run_topics import RunTopics, create_run_topics

ROLES_BY_MODE = {name: m.roles for name, m in MODES.items()}
EVALUATOR = "evaluator"
DASHBOARD = "dashboard"  # `rft dashboard` on monitor.dashboard_port: the live run page, stopped with the run
EXPLORE_IDLE_EXIT_S = 30.0
SERVER, JOINER = "server", "joiner"  # serve mode's parts: `rft serve` (essential) and the joiner (restartable)


@dataclass
class Part:
    name: str
    process: subprocess.Popen
    log_path: Path


STOP_REQUESTED = threading.Event()
# set while PartRunner.start forks a part and records it: a stop then only sets STOP_REQUESTED, and start raises once
# the part is recorded (a KeyboardInterrupt between the fork and the record left a part nobody stopped)
STARTING_PART = threading.Event()


def _install_stop_signals() -> None:
    """SIGINT (Ctrl-C) and SIGTERM stop the whole run. The flag is checked between stages and on every supervision
    tick, so a stop that arrives while library code swallows the KeyboardInterrupt is still honoured."""
    def on_signal(signum, frame):
        STOP_REQUESTED.set()
        if not STARTING_PART.is_set():
            raise KeyboardInterrupt

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)


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
    _install_stop_signals()
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


def _endpoints_refused(cfg: Config) -> str | None:
    """Why an HTTP endpoint this run would start (`rft dashboard`, `rft serve`) must not: a key that cannot be read,
    or one listening beyond loopback without a key (rft/observability/access.py); None when they may start."""
    serving = "serve" in ROLES_BY_MODE[cfg.run.mode]
    if not (cfg.monitor.dashboard_port or serving):
        return None
    from rft.observability.access import AccessConfigError, dashboard_access, serve_access  # heavy: fastapi (the web extra)
    try:
        if cfg.monitor.dashboard_port:
            dashboard_access(cfg.monitor, cfg.monitor.dashboard_host)
        if serving:
            serve_access(cfg.serve, cfg.serve.host)
    except AccessConfigError as e:
        return str(e)
    return None


def run(cfg: Config) -> int:
    if cfg.stages:
        return run_stages(cfg)
    refused = _endpoints_refused(cfg)
    if refused:
        print(f"[rft] {refused}", file=sys.stderr, flush=True)
        return 2
    run_dir = cfg.run_dir
    make_private_dir(run_dir / "logs")
    with KafkaEndpoint(cfg.kafka, log_path=run_dir / "logs" / "broker.log", run_dir=run_dir) as bootstrap:
        cfg.kafka.bootstrap_servers = bootstrap
        config_path = run_dir / "config.yaml"
        write_run_config(cfg, config_path)
        print(f"[rft] run {cfg.run.name!r} mode {cfg.run.mode} -> {run_dir} (kafka {bootstrap})", flush=True)
        create_run_topics(RunTopics.of(cfg), cfg.kafka)
        roles = ROLES_BY_MODE[cfg.run.mode]
        online = "explorers" in roles and selector_needs_rewards(cfg.data)  # publish as rewards come in
        if "explorers" in roles and not online:
            _publish_tasks(cfg)
        if "explorers" in roles:
            _fresh_explorers_group(cfg)
        if cfg.replay.from_data and not _publish_demonstrations(cfg, cfg.replay.topic or cfg.topic("experiences")):
            return 2
        demonstrations = build_algorithm(cfg.algorithm).needs.demonstrations if "trainer" in roles else None
        if demonstrations is not None and not _publish_demonstrations(cfg, demonstrations.topic_of(cfg)):
            return 2  # the demonstrations the algorithm mixes into its steps
        try:
            gpus = gpu_plan(cfg, roles, visible_gpus())
        except LaunchError as e:
            print(f"[rft] {e}", file=sys.stderr, flush=True)
            return 2
        threads = cpu_threads_per_part(cfg, roles, gpus)
        bf16_hint(cfg, gpus)
        runner = PartRunner(run_dir, threads=threads, cores=core_board(cfg, roles, threads, run_dir))
        try:
            if cfg.monitor.dashboard_port:
                runner.start(DASHBOARD, [sys.executable, "-m", "rft.cli", "dashboard", str(config_path),
                                         "--port", str(cfg.monitor.dashboard_port)])
            if online:
                runner.start("publisher", [sys.executable, "-m", "rft.cli", "publish", str(config_path)])
            if "trainer" in roles:
                runner.start("trainer", _trainer_command(cfg, config_path), gpus=gpus.get("trainer"))
            if "explorers" in roles:
                for i in range(cfg.explorer.replicas):
                    runner.start(f"explorer-{i}", [sys.executable, "-m", "rft.cli", "explorer", str(config_path),
                                                   "--explorer-id", f"explorer-{i}", *_explore_only_exit(cfg)],
                                 gpus=gpus.get(f"explorer-{i}"))
            if "serve" in roles:  # serve mode: the endpoint and the joiner (rft/serve/)
                runner.start(SERVER, [sys.executable, "-m", "rft.cli", "serve", str(config_path)],
                             gpus=gpus.get(SERVER))
                runner.start(JOINER, [sys.executable, "-m", "rft.cli", "joiner", str(config_path)])
            _start_evaluator(cfg, runner, config_path, roles, gpus=gpus.get(EVALUATOR))
            progress = MetricsProgress(run_dir / "metrics.jsonl", cfg.run.max_steps) if cfg.monitor.progress else None
            watch = StallWatch(cfg, run_dir / "metrics.jsonl") if "explorers" in roles else None
            code = runner.supervise(main_part="trainer" if "trainer" in roles else None,
                                    on_tick=_ticks(progress, watch), essential={"publisher", SERVER})
            if code == 0 and EVALUATOR in runner.parts:
                runner.stop_all(keep=(EVALUATOR,))
                runner.finish(EVALUATOR, timeout_s=cfg.eval.finish_timeout_s, on_tick=progress)
        except KeyboardInterrupt:
            print("\n[rft] interrupted: stopping every part", flush=True)
            code = 130
        finally:
            runner.stop_all()
        if code == 0 and "trainer" in roles:
            _plot(cfg)
        return code


def make_private_dir(path: Path) -> None:
    """`path` and its missing parents created 0700; the run directory (its parent) made 0700 if it was not."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(path.parent, 0o700)


def write_run_config(cfg: Config, path: Path) -> None:
    """`cfg` as the parts read it, at `path` (mode 0600): secrets redacted (rft.config.redacted: `${ENV}`
    references as written); a secret written in the config itself reaches the parts through this process's
    environment, which they inherit, as `${RFT_SECRET_<KEY>:-<redacted>}` (a reader without it sees REDACTED)."""
    refs = dict(cfg.env_refs)
    for key, value in secret_values(cfg).items():
        name = "RFT_SECRET_" + re.sub(r"[^A-Za-z0-9]+", "_", key).strip("_").upper()
        os.environ[name] = json.dumps(value)  # YAML reads it back with its type ("123" stays a string)
        refs[key] = f"${{{name}:-{REDACTED}}}"
    cfg.env_refs = refs
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(cfg.to_yaml())
    os.chmod(path, 0o600)  # a file from an earlier run keeps its mode otherwise


def _ticks(*calls):
    """One supervision tick calling each of `calls` that is not None (None when none is)."""
    calls = [c for c in calls if c is not None]
    if not calls:
        return None

    def tick() -> None:
        for call in calls:
            call()
    return tick


def _start_evaluator(cfg: Config, runner: PartRunner, config_path: Path, roles: tuple[str, ...], *,
                     gpus: str | None = None) -> None:
    """Periodic evaluation (`eval.every_steps`): `rft eval --follow` beside the trainer, reading the weight store
    (see rft/evaluation/main.py); it never blocks training."""
    if not cfg.eval.every_steps or "trainer" not in roles:
        return
    if not mode(cfg.run.mode).publishes_weights:
        print("[rft] eval.every_steps: an offline replay publishes no weights to evaluate; use `rft eval "
              "--checkpoint` on its final weights", flush=True)
        return
    runner.start(EVALUATOR, [sys.executable, "-m", "rft.cli", "eval", str(config_path), "--follow"],
                 blocked_signals=(signal.SIGUSR1,), gpus=gpus)  # SIGUSR1 until it can take `finish` (PartRunner)


def _publish_tasks(cfg: Config) -> None:
    """Publish the task set. A tasks topic that holds it already (a resumed run on a durable broker) is left as it
    is; one that holds part of it (a publish cut short, by Ctrl-C or a crash, before the broker acknowledged every
    task) gets the tasks it lacks, else the run would wait for groups that can never come."""
    topics = RunTopics.of(cfg)
    source = connect(cfg.kafka).source()
    try:
        existing = sum(source.end_offsets(topics.tasks).values())
    finally:
        source.close()
    if existing and existing >= build_picker(cfg.data, run_id=topics.run).remaining:
        print(f"[rft] {topics.tasks} already holds {existing} tasks: not publishing again", flush=True)
        return
    present = published_groups(topics, cfg.kafka) if existing else set()
    count = publish_tasks(cfg.data, topics, cfg.kafka, progress=cfg.monitor.progress, skip=present)
    if present:
        print(f"[rft] {topics.tasks} held {len(present)} of its tasks (a publish cut short): published the {count} "
              "it lacked", flush=True)
    else:
        print(f"[rft] published {count} tasks to {topics.tasks}", flush=True)


def _fresh_explorers_group(cfg: Config) -> None:
    """A restarted run (its explorers' group committed offsets before) starts its explorers in a fresh consumer
    group, so that a group wedged by the fleet's last stop cannot hold them up (rft/explorer/membership.py)."""
    topics = RunTopics.of(cfg)
    group = fresh_group_for_restart(connect(cfg.kafka), topics, by="rft-run")
    if group is not None:
        print(f"[rft] {topics.tasks} was consumed before: the explorers start in a fresh consumer group, {group} "
              "(seeded with the old group's positions)", flush=True)


def _publish_demonstrations(cfg: Config, topic: str) -> bool:
    """Fill `topic` (the offline replay's, or the demonstrations topic the algorithm reads) from the dataset, unless
    it already holds records (a resumed stage, or demonstrations published beforehand). False (the error printed)
    when the dataset is not usable."""
    try:
        count = publish_demonstrations(cfg.data, cfg.model, cfg.kafka, topic=topic, run_id=cfg.run.name,
                                       tools=prompt_tools(cfg.explorer))
    except DatasetError as e:
        print(f"[rft] demonstrations: {e}", file=sys.stderr)
        return False
    print(f"[rft] {topic}: " + (f"published {count} demonstrations" if count else "holds records already: not "
                                "publishing demonstrations again"), flush=True)
    return True


def run_stages(cfg: Config) -> int:
    """The stages of `cfg` in order, on one broker; a finished stage is skipped, a failed one ends the run."""
    make_private_dir(cfg.run_dir / "logs")
    with KafkaEndpoint(cfg.kafka, log_path=cfg.run_dir / "logs" / "broker.log",
                       run_dir=cfg.run_dir) as bootstrap:
        cfg.kafka.bootstrap_servers = bootstrap
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


def _explore_only_exit(cfg: Config) -> list[str]:
    """In explore mode nothing else ends the run: explorers exit once the task set is exhausted."""
    if mode(cfg.run.mode).trainer:
        return []
    return ["--exit-when-idle", str(cfg.explorer.exit_when_idle_s or EXPLORE_IDLE_EXIT_S)]


_EXCEPTION_LINE = re.compile(  # `[rankN]: ` (torchrun's prefix), then `XxxError: message` or `pkg.mod.Name: message`
    r"(?:\[rank\d+\]:\s*)?((?:[A-Za-z_]\w*\.)*[A-Za-z_]\w*(?:Error|Exception|Exit|Interrupt)(?::\s.*)?"
    r"|(?:[a-z_]\w*\.)+[A-Z]\w*:\s.*)$")
_LAUNCHER_EXCEPTIONS = ("ChildFailedError", "torch.distributed.elastic")


def failure_line(lines: list[str]) -> str | None:
    """The part's own exception from its log, `XxxError: message` (the last such line that is not torchrun's
    ChildFailedError report about its worker); None when the log names none."""
    for line in reversed(lines):
        m = _EXCEPTION_LINE.match(line.strip())
        if m and not any(word in line for word in _LAUNCHER_EXCEPTIONS):
            return m.group(1)
    return None


class LaunchError(RuntimeError):
    pass


# The device nodes a GPU driver makes on Linux: NVIDIA's, AMD's (ROCm, which torch.cuda also counts) and WSL's. With
# none of them torch sees no GPU, so the launcher need not import torch to learn so: that import took 1.5-1.8 s of a
# 2-core machine before any part of a run could start.
GPU_DEVICE_NODES = ("/dev/nvidiactl", "/dev/kfd", "/dev/dxg")


def visible_gpus() -> list[str]:
    """This machine's GPUs as CUDA_VISIBLE_DEVICES entries (empty on a CPU machine). NVML only: no CUDA context; on
    a Linux machine with no GPU driver's device node (`GPU_DEVICE_NODES`), torch is not even imported."""
    if "CUDA_VISIBLE_DEVICES" in os.environ:
        return [d for d in os.environ["CUDA_VISIBLE_DEVICES"].split(",") if d.strip()]
    if sys.platform == "linux" and not any(os.path.exists(node) for node in GPU_DEVICE_NODES):
        return []
    import torch
    return [str(i) for i in range(torch.cuda.device_count())]


def gpu_plan(cfg: Config, roles: tuple[str, ...], gpus: list[str]) -> dict[str, str]:
    """Disjoint GPUs for the parts of a one-machine run: the trainer's TP x PP x DP first, then each explorer's
    tensor_parallel_size, then the evaluator's. Empty on a CPU machine; LaunchError when the GPUs do not suffice,
    unless `run.share_gpus`: then the parts take the GPUs round-robin and share them (a part never gets one GPU
    twice; the explorers' `gpu_memory_utilization` must leave room for the trainer on a shared GPU)."""
    if not gpus:
        return {}
    needs = compute_parts(cfg, roles)
    total = sum(n for _, n in needs)
    widest = max((n for _, n in needs), default=0)
    if widest > len(gpus) or (total > len(gpus) and not cfg.run.share_gpus):
        parts = " + ".join(f"{name} {n}" for name, n in needs)
        raise LaunchError(f"this machine has {len(gpus)} GPUs, the run needs {total} ({parts}): lower "
                          "trainer.data_parallel or explorer.replicas, start the explorers elsewhere (`rft explorer`)"
                          + ("" if widest > len(gpus) else ", or let the parts share GPUs (run.share_gpus: true)"))
    plan, next_gpu = {}, 0
    for name, n in needs:
        plan[name] = ",".join(gpus[(next_gpu + i) % len(gpus)] for i in range(n))
        next_gpu += n
    return plan


def compute_parts(cfg: Config, roles: tuple[str, ...]) -> list[tuple[str, int]]:
    """The parts of a one-machine run that compute, each with its number of worker processes (= GPUs on a GPU
    machine): the trainer's TP x PP x DP ranks, each explorer's tensor_parallel_size, the evaluator's."""
    t, tp = cfg.trainer, cfg.explorer.tensor_parallel_size
    parts: list[tuple[str, int]] = []
    if "trainer" in roles:
        parts.append(("trainer", t.tensor_parallel * t.pipeline_parallel * t.data_parallel))
    if "explorers" in roles:
        parts += [(f"explorer-{i}", tp) for i in range(cfg.explorer.replicas)]
    if "serve" in roles:
        parts.append((SERVER, tp))
    if cfg.eval.every_steps and "trainer" in roles and mode(cfg.run.mode).publishes_weights:
        parts.append((EVALUATOR, tp))
    return parts


def cpu_threads_per_part(cfg: Config, roles: tuple[str, ...], gpus: dict[str, str]) -> int | None:
    """On a machine without GPUs, the OMP_NUM_THREADS each part gets: this process's cores split evenly over the
    compute processes (`compute_parts`), at least 1. Parts that each spin as many threads as there are cores fight
    over them: on 2 cores the flagship step took twice as long. None (leave the environment alone) with GPUs, or
    when OMP_NUM_THREADS is set already (the operator's choice wins)."""
    if gpus or os.environ.get("OMP_NUM_THREADS"):
        return None
    processes = sum(n for _, n in compute_parts(cfg, roles))
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    threads = max(1, cores // max(1, processes))
    print(f"[rft] {cores} CPU cores for {processes} compute processes: OMP_NUM_THREADS={threads} each "
          "(set OMP_NUM_THREADS to choose)", flush=True)
    return threads


def bf16_hint(cfg: Config, gpus: dict[str, str], cpuinfo: Path = Path("/proc/cpuinfo")) -> bool:
    """On a machine without GPUs whose CPU multiplies bfloat16 natively, a float32 run is told that
    `model.dtype=bfloat16` is faster here; True when it was. The default stays float32: without those instructions
    vLLM's bfloat16 is far slower, and a config should train alike on every machine it meets."""
    flags = native_bf16_flags(cpuinfo) if not gpus and cfg.model.dtype == "float32" else []
    if flags:
        print(f"[rft] this CPU computes bfloat16 natively ({', '.join(flags)}): --set model.dtype=bfloat16 trained the "
              "flagship's steps about 1.5x faster on one (docs/benchmarks.md, \"bfloat16 on the CPU\")", flush=True)
    return bool(flags)


def core_board(cfg: Config, roles: tuple[str, ...], threads: int | None, run_dir: Path) -> dict[str, str]:
    """Cores that follow the work (rft/cores.py): when `cpu_threads_per_part` split the cores (`threads` not None)
    and the run has a trainer and explorers here, a board at `run_dir/cores` on which the trainer and each explorer
    mark themselves busy or waiting, and from which those that compute take the threads of those that wait. Returns
    each part's `RFT_CORES` value ({} without a board; `rft run --set trainer.borrow_cores=false` turns it off)."""
    if threads is None or "trainer" not in roles or "explorers" not in roles or not cfg.trainer.borrow_cores:
        return {}
    parts = {name: (threads * n, n) for name, n in compute_parts(cfg, roles)
             if name == "trainer" or name.startswith("explorer-")}
    board = write_board(run_dir / "cores", parts)
    print(f"[rft] cores follow the work: the trainer and the explorers take the threads of those that wait "
          f"({run_dir / 'cores'})", flush=True)
    return board


def _trainer_command(cfg: Config, config_path: Path) -> list[str]:
    t = cfg.trainer
    nproc = t.tensor_parallel * t.pipeline_parallel * t.data_parallel
    # torchrun whose stores listen on localhost only (rft/cli/torchrun.py)
    return [sys.executable, "-m", "rft.cli.torchrun", "--standalone", f"--nproc-per-node={nproc}",
            "-m", "rft.cli", "trainer", str(config_path)]


def _plot(cfg: Config) -> None:
    metrics = cfg.run_dir / "metrics.jsonl"
    if metrics.exists():
        png = plot_rewards(metrics, cfg.run_dir / "reward.png", title=cfg.run.name)
        print(f"[rft] reward curve: {png}", flush=True)


class PartRunner:
    """Child processes of a run, each in its own process group, each logging to its own file."""

    def __init__(self, run_dir: Path, *, threads: int | None = None, cores: dict[str, str] | None = None):
        """`threads`: OMP_NUM_THREADS for every part (None: inherited; see cpu_threads_per_part). `cores`: part name
        -> its RFT_CORES (see core_board); other parts get none."""
        self.run_dir, self.threads, self.cores = run_dir, threads, cores or {}
        self.parts: dict[str, Part] = {}

    def start(self, name: str, command: list[str], *, blocked_signals: tuple[int, ...] = (),
              gpus: str | None = None) -> None:
        """`blocked_signals` start blocked (pending until the part installs its handler and unblocks them), so a
        signal sent early neither kills it nor gets lost. `gpus`: the part's CUDA_VISIBLE_DEVICES (see gpu_plan)."""
        log_path = self.run_dir / "logs" / f"{name}.log"
        log = open(log_path, "ab")
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        if self.threads is not None:
            env["OMP_NUM_THREADS"] = str(self.threads)
        env.pop(CoreShare.ENV, None)  # a board is this run's: never one inherited from a run that started this one
        if name in self.cores:
            env[CoreShare.ENV] = self.cores[name]
        if gpus is not None:
            env["CUDA_VISIBLE_DEVICES"] = gpus
        block = (lambda: signal.pthread_sigmask(signal.SIG_BLOCK, blocked_signals)) if blocked_signals else None
        STARTING_PART.set()  # a stop from here to the record is raised after it (STARTING_PART)
        try:
            process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
                                       preexec_fn=block)
            self.parts[name] = Part(name, process, log_path)
        finally:
            STARTING_PART.clear()
        print(f"[rft] started {name} (pid {process.pid}, log {log_path})", flush=True)
        if STOP_REQUESTED.is_set():
            raise KeyboardInterrupt  # the run's `finally` stops every recorded part, this one too

    def supervise(self, main_part: str | None, *, on_tick=None, poll_s: float = 0.5,
                  essential: set[str] = frozenset()) -> int:
        """Wait for the main part; `essential` parts end the run (with 1) when they fail, others are tolerated."""
        reported: set[str] = set()
        while True:
            if STOP_REQUESTED.is_set():
                raise KeyboardInterrupt
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
        lines = part.log_path.read_text(errors="replace").splitlines()
        print(f"[rft] {part.name} exited with code {code}; last lines of {part.log_path}:", file=sys.stderr)
        for line in lines[-25:]:
            print(f"    {line}", file=sys.stderr)
        cause = failure_line(lines)
        if cause:
            print(f"[rft] {part.name} failed: {cause}", file=sys.stderr)
        sys.stderr.flush()

    def finish(self, name: str, *, timeout_s: float, on_tick=None, poll_s: float = 0.5) -> None:
        """Ask a part to finish its work and exit (SIGUSR1, to its main process only) and wait at most `timeout_s`
        (after that, stop_all stops it)."""
        part = self.parts[name]
        if part.process.poll() is not None:
            return
        print(f"[rft] waiting for the {name} to finish (at most {timeout_s:.0f} s)", flush=True)
        part.process.send_signal(signal.SIGUSR1)
        deadline = time.monotonic() + timeout_s
        while part.process.poll() is None and time.monotonic() < deadline:
            if on_tick is not None:
                on_tick()
            time.sleep(poll_s)
        if on_tick is not None:
            on_tick()
        code = part.process.poll()
        if code is None:
            print(f"[rft] the {name} did not finish within {timeout_s:.0f} s: stopping it", flush=True)
        elif code != 0:
            self._report_failure(part, code)

    def stop_all(self, grace_s: float = 15.0, *, keep: tuple[str, ...] = ()) -> None:
        """SIGTERM to every part still running (but those named in `keep`), SIGKILL after `grace_s`."""
        alive = [p for p in self.parts.values() if p.process.poll() is None and p.name not in keep]
        for part in alive:
            signal_group(part.process, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for part in alive:
            try:
                part.process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                signal_group(part.process, signal.SIGKILL)
                part.process.wait()


class MetricsProgress:
    """Prints one console line per trainer step as metrics.jsonl grows, with a progress bar and the time left (the
    trainer's own log has more)."""

    def __init__(self, path: Path, max_steps: int):
        self.path, self.max_steps, self.offset = path, max_steps, 0
        self.started = time.time()
        self._first: tuple[int, float] | None = None

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
            if "eval/checkpoint" in m:
                print(f"[rft] eval {m['eval/checkpoint']}: {_eval_summary(m)}", flush=True)
                continue
            print(f"[rft] step {m['step']:>4}/{self.max_steps} {self._bar(m['step'])}  "
                  f"reward {m.get('reward_mean', float('nan')):.3f}  loss {m.get('loss', float('nan')):+.4f}  "
                  f"staleness max {m.get('staleness_max', 0)}  dropped {m.get('dropped_stale', 0)}  "
                  f"{time.time() - self.started:6.0f} s{self._eta(m)}", flush=True)

    def _bar(self, step: int, width: int = 20) -> str:
        done = min(width, round(width * step / max(1, self.max_steps)))
        return "[" + "#" * done + "." * (width - done) + "]"

    def _eta(self, record: dict) -> str:
        """Remaining time at the pace of the steps this process has seen (a resume replays older lines first)."""
        if record.get("time", 0) < self.started:
            return ""
        if self._first is None:
            self._first = (record["step"], record["time"])
            return ""
        steps, seconds = record["step"] - self._first[0], record["time"] - self._first[1]
        if steps <= 0:
            return ""
        return f"  eta {seconds / steps * max(0, self.max_steps - record['step']):5.0f} s"


def _eval_summary(record: dict) -> str:
    """`<set>/accuracy 0.520  <set>/pass@4 0.830  <set>/mean@4 0.610 ...` from an evaluation's metrics record."""
    shown = ("accuracy", "pass@", "mean@")
    return "  ".join(f"{key.removeprefix('eval/')} {value:.3f}" for key, value in record.items()
                     if key.startswith("eval/") and key.rsplit("/", 1)[-1].startswith(shown))


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
    cfg = config_from_args(args, need_model=True)
    if not cfg.replay.from_data:  # replays an existing topic, on the broker that holds it
        require_broker(cfg, "rft replay")
    if not build_algorithm(cfg.algorithm).supports_replay:
        print(f"rft replay: algorithm {cfg.algorithm.name!r} cannot train on recorded experiences as configured "
              f"({REPLAY_HINT})", file=sys.stderr)
        return 2
    return run_until_stopped(cfg)
