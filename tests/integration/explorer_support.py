"""Shared by the explorer integration tests: a run config for the tiny model, explorers as `rft explorer`
subprocesses, and readers that collect what explorers wrote to the experiences and control topics."""
from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import yaml

from rft.data.tasks import load_rows, rows_to_tasks
from rft.run.config import Config, load_config
from rft.schema import ControlMessage, ExperienceGroup, decode
from rft.transport import connect
from tests.waiting import wait_until

REPO = Path(__file__).resolve().parents[2]



def publish_numbered_tasks(cfg: Config) -> list:
    """Create the run's topics and publish the tasks of `cfg.data`, their ids task-0, task-1, ... in order; returns
    the tasks."""
    connect(cfg.kafka).admin().create_topics([cfg.topic(k) for k in ("tasks", "experiences", "control",
                                                                     "dead_letter")])
    tasks = [dataclasses.replace(t, task_id=f"task-{i}") for i, t in
             enumerate(rows_to_tasks(load_rows(cfg.data), cfg.data, run_id=cfg.run.name))]
    sink = connect(cfg.kafka).sink()
    for t in tasks:
        sink.send_record(cfg.topic("tasks"), t, key=t.task_id)
    sink.flush()
    sink.close()
    return tasks

def write_config(path: Path, *, run: str, bootstrap: str, model: Path, store: Path, partitions: int = 2,
                 tasks: int = 16, **explorer) -> Path:
    """A small explore-mode run on the tiny model: `tasks` copy_char tasks, one-token answers; `explorer`: keys of
    the explorer section."""
    raw = {
        "run": {"name": run, "mode": "explore"},
        "model": {"path": str(model), "max_prompt_len": 16, "max_response_len": 8},
        "kafka": {"bootstrap_servers": bootstrap, "partitions": partitions},
        "explorer": {"n_samples": 4, "max_tokens": 1, "tasks_per_batch": 2, "reward": "char_accuracy",
                     "heartbeat_s": 1.0, "cpu_kvcache_gb": 0.1, **explorer},
        "data": {"path": "copy_char", "format": "generated", "generated_tasks": tasks},
        "sync": {"weight_store": str(store)},
    }
    path.write_text(yaml.safe_dump(raw))
    return path


def create_topics(cfg: Config) -> None:
    admin = connect(cfg.kafka, cfg.kafka.bootstrap_servers).admin()
    try:
        admin.create_topics([cfg.topic(k) for k in ("tasks", "experiences", "control", "dead_letter")])
    finally:
        admin.close()


def subprocess_env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
                PYTHONUNBUFFERED="1")


def start_explorer(config: Path | list[Path], explorer_id: str, log_dir: Path, *overrides: str,
                   replicas: int = 1) -> subprocess.Popen:
    """`rft explorer CONFIG [MORE_CONFIGS] --explorer-id ID [--replicas N]` in its own process group."""
    sets = [a for o in overrides for a in ("--set", o)]
    configs = [str(c) for c in (config if isinstance(config, list) else [config])]
    log = open(log_dir / f"{explorer_id}.log", "ab")
    return subprocess.Popen([sys.executable, "-m", "rft.cli", "explorer", *configs, "--explorer-id", explorer_id,
                             "--replicas", str(replicas), *sets], stdout=log, stderr=subprocess.STDOUT,
                            env=subprocess_env(), start_new_session=True)


def kill_tree(process: subprocess.Popen, sig: int = signal.SIGKILL) -> None:
    """Signal a process, its process group and every descendant (replicas run in sessions of their own)."""
    import psutil

    try:
        descendants = psutil.Process(process.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        descendants = []
    for pid in [process.pid] + [d.pid for d in descendants]:
        try:
            os.killpg(pid, sig) if pid == process.pid else os.kill(pid, sig)
        except ProcessLookupError:
            pass


def log_tail(log_dir: Path, lines: int = 30) -> str:
    out = []
    for log in sorted(log_dir.glob("*.log")):
        tail = log.read_text(errors="replace").splitlines()[-lines:]
        out.append(f"--- {log.name}\n" + "\n".join(tail))
    return "\n".join(out)


class TopicReader:
    """Everything written to one topic since the start, decoded; `wait_for` polls until a condition holds."""

    def __init__(self, cfg: Config, topic: str):
        self.source = connect(cfg.kafka, cfg.kafka.bootstrap_servers).source()
        self.source.assign([topic])
        self.source.seek_to_beginning()
        self.topic = topic
        self.records: list = []
        self.raw = []

    def poll(self) -> None:
        for m in self.source.poll(timeout_s=0.5):
            self.raw.append(m)
            try:
                self.records.append(decode(m.value, m.headers))
            except ValueError:
                self.records.append(None)

    def catch_up(self, timeout_s: float = 30.0) -> None:
        """Read every record the topic held when called (its end offsets then): one `poll` returns one fetch's worth,
        so a check after a single poll can miss a record written long before it."""
        end = self.source.end_offsets(self.topic)
        wait_until(lambda: all(self.source.positions().get(k, 0) >= v for k, v in end.items()), timeout=timeout_s,
                   what=f"{self.topic} read up to {end}", between=self.poll)

    def wait_for(self, condition: Callable[[], object], *, timeout_s: float, what: str,
                 alive: list[subprocess.Popen] = (), log_dir: Path | None = None) -> object:
        """`wait_until(condition)` polling this topic between checks; fails at once if one of `alive` exited, with
        the explorers' logs under `log_dir`."""
        return wait_until(condition, timeout=timeout_s, what=what, alive=alive, between=self.poll,
                          context=(lambda: log_tail(log_dir)) if log_dir else None)

    def close(self) -> None:
        self.source.close()


class Experiences(TopicReader):
    @property
    def groups(self) -> list[ExperienceGroup]:
        return [r for r in self.records if isinstance(r, ExperienceGroup)]

    def by(self, explorer_id: str) -> list[ExperienceGroup]:
        return [g for g in self.groups if g.explorer_id == explorer_id]


class Control(TopicReader):
    def messages(self, kind: str, sender: str | None = None) -> list[ControlMessage]:
        return [r for r in self.records if isinstance(r, ControlMessage) and r.kind == kind
                and (sender is None or r.sender == sender)]


def load(config: Path) -> Config:
    return load_config(config)
