"""What the run page shows: one run's `metrics.jsonl` and control topic folded into a JSON-able snapshot.

Sources, and nothing else (no database): `<run dir>/metrics.jsonl`, read as it grows (`MetricsTail`; records are
never merged here), and the run's control topic, followed from its beginning (`ControlFollower`) and folded by
`rft.ops.status.RunStatus` (the fold `rft status` uses). The broker comes from the run's own `config.yaml` (`rft run`
writes the address of the broker it started there), re-read when it changes. Each (re)connection reads the control
topic again from its beginning; while the broker cannot be reached the last view is kept and the snapshot says so.

States (`state`): `not-started` (no metrics, no control message), `running`, `finished` (the trainer said so),
`ended` (metrics but no broker to ask). `broker.state`: `connected`, `unreachable` (with the error), `connecting`,
`no-topic`, `embedded` (the run's broker has not written its address yet), `no-config`. Records that do not fit are
skipped and counted (`skipped`), never raised.

Threads: a `RunWatch` refreshes from one background thread; `snapshot()` may be called from any thread.
"""
from __future__ import annotations

import json
import math
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rft.config import ConfigError
from rft.ops.status import RunStatus, explorer_rows, tasks_group_of, topic_lags
from rft.run.config import Config, load_config
from rft.schema import ControlMessage
from rft.transport import Admin, RecordSource, Transport, connect
from rft.transport.control import ExplorerJoin, ExplorerLeave, TrainerFinished, TrainerStarted, control_messages

LAGS_EVERY_S = 3.0  # how often the consumer lags are asked of the broker
RETRY_S = 2.0  # pause after a failed connection
FLEET_EVENTS = {ExplorerJoin.KIND: "join", ExplorerLeave.KIND: "leave", TrainerStarted.KIND: "trainer_started",
                TrainerFinished.KIND: "trainer_finished"}


def connect_for(cfg: Config) -> Transport:
    """The transport of a run's broker (the default of `ControlFollower`)."""
    return connect(cfg.kafka)


# --------------------------------------------------------------------------------------------------
# metrics.jsonl


def _clean(value: Any) -> Any:
    """A metrics value as the page may use it: a finite number, a string, a flat map of finite numbers (the
    staleness histogram); None otherwise."""
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, (int, float)):
        return value if math.isfinite(value) else None
    if isinstance(value, str):
        return value[:200]
    if isinstance(value, dict):
        return {str(k)[:64]: v for k, v in ((k, _clean(v)) for k, v in value.items())
                if isinstance(v, (int, float))}
    return None


def metrics_record(line: str) -> dict | None:
    """One metrics line as a record for the page (`time` a number, `step` an int when present, values cleaned by
    `_clean`), or None when the line is not such a record."""
    try:
        raw = json.loads(line)
    except ValueError:
        return None
    if not isinstance(raw, dict) or not isinstance(raw.get("time"), (int, float)) or isinstance(raw["time"], bool):
        return None
    if "step" in raw and (not isinstance(raw["step"], int) or isinstance(raw["step"], bool)):
        return None
    return {str(k): v for k, v in ((k, _clean(v)) for k, v in raw.items()) if v is not None}


class MetricsTail:
    """`metrics.jsonl` read as it grows: `records` in file order, `malformed` lines skipped. A line still being
    written (no newline yet) waits for the next `read()`. A file replaced or truncated (a new run of the same name)
    starts over: `records` empties and `epoch` counts up, so a reader that kept an offset knows to start again.
    `read()` runs on one thread while others take `view()`s: the lock keeps records, total and epoch of one moment
    (a stream that counted a record appended after its slice was taken skipped it for good)."""

    def __init__(self, path: Path):
        self.path = path
        self.records: list[dict] = []
        self.malformed = 0
        self.epoch = 0
        self._offset = 0
        self._inode: int | None = None
        self._lock = threading.Lock()

    def view(self, since: int = 0, epoch: int | None = None) -> tuple[list[dict], int, int, int, int]:
        """(records from index `since` on - all of them when `epoch` is not the current one -, the index they
        start at, the total, the epoch, the malformed lines), all of one moment."""
        with self._lock:
            if epoch is not None and epoch != self.epoch:
                since = 0
            return self.records[since:], since, len(self.records), self.epoch, self.malformed

    def read(self) -> None:
        with self._lock:
            self._read()

    def _read(self) -> None:
        try:
            stat = os.stat(self.path)
        except FileNotFoundError:
            if self._inode is not None:
                self._restart(None)
            return
        if stat.st_ino != self._inode or stat.st_size < self._offset:
            self._restart(stat.st_ino)
        if stat.st_size == self._offset:
            return
        with open(self.path, "rb") as f:
            f.seek(self._offset)
            data = f.read()
        complete = data[:data.rfind(b"\n") + 1]
        self._offset += len(complete)
        for line in complete.decode(errors="replace").splitlines():
            if not line.strip():
                continue
            record = metrics_record(line)
            if record is None:
                self.malformed += 1
            else:
                self.records.append(record)

    def _restart(self, inode: int | None) -> None:
        if self._inode is not None or self.records:
            self.epoch += 1
        self.records, self.malformed, self._offset, self._inode = [], 0, 0, inode


# --------------------------------------------------------------------------------------------------
# The control topic


@dataclass(frozen=True)
class _Clients:
    """A connection to the run's broker: the control topic's reader, the admin client (lags) and the fold it feeds."""
    source: RecordSource
    admin: Admin
    status: RunStatus


class ControlFollower:
    """One run's control topic, followed: `step()` connects when needed, polls once and folds what it read into
    `status` (rft.ops.status.RunStatus). Call `step()` from one thread; read the fields under `lock`.

    - `broker`: {"state", "bootstrap", "error"} (states: module docstring);
    - `events`: fleet and trainer events in time order ({"time", "kind", "who"}, kinds of FLEET_EVENTS);
    - `lags`: what rft.ops.status.topic_lags said last (empty until asked);
    - `undecodable`: records that are no schema record; `status.view.malformed`: control messages that do not
      fit their kind. Both skipped.
    A (re)connection reads the topic again from its beginning into a fresh fold."""

    def __init__(self, *, transport_for: Callable[[Config], Transport] = connect_for):
        self.transport_for = transport_for
        self.lock = threading.Lock()
        self.broker = {"state": "connecting", "bootstrap": "", "error": ""}
        self.status: RunStatus | None = None
        self.events: list[dict] = []
        self.lags: dict = {}
        self.undecodable = 0
        self._clients: _Clients | None = None
        self._bootstrap = ""
        self._lags_at = 0.0

    def step(self, cfg: Config | None, *, poll_s: float = 1.0) -> None:
        if cfg is None or cfg.kafka.bootstrap_servers == "embedded":
            self.close()
            self._set_broker("no-config" if cfg is None else "embedded", "", "")
            time.sleep(poll_s)
            return
        bootstrap = cfg.kafka.bootstrap_servers
        if bootstrap != self._bootstrap:
            self.close()
            self._bootstrap = bootstrap
        try:
            clients = self._clients or self._connect(cfg)
            if clients is None:
                time.sleep(poll_s)
                return
            messages = list(control_messages(clients.source.poll(timeout_s=poll_s), undecodable=self._count))
            with self.lock:
                for message in sorted(messages, key=lambda m: m.created_at):  # partitions interleave
                    self._apply(clients.status, message)
            if time.monotonic() - self._lags_at > LAGS_EVERY_S:
                with self.lock:
                    consumed, group = dict(clients.status.trainer.offsets), tasks_group_of(cfg, clients.status)
                lags = topic_lags(cfg, clients.source, clients.admin, consumed, group)
                with self.lock:
                    self.lags, self._lags_at = lags, time.monotonic()
        except Exception as e:  # the broker went away: TransportError, or kafka-python's own errors
            self.close()
            self._set_broker("unreachable", bootstrap, f"{type(e).__name__}: {e}"[:400])
            time.sleep(RETRY_S)

    def _connect(self, cfg: Config) -> _Clients | None:
        """Open the clients and start a fresh fold; None (broker state no-topic) when the topic is not there."""
        transport = self.transport_for(cfg)
        admin = transport.admin()
        try:
            if cfg.topic("control") not in admin.list_topics():
                self._set_broker("no-topic", cfg.kafka.bootstrap_servers, "")
                admin.close()
                return None
            source = transport.source(client_id=f"{cfg.run.name}-dashboard")
        except Exception:
            admin.close()
            raise
        self._clients = clients = _Clients(source, admin, RunStatus(cfg.explorer.heartbeat_s))
        source.assign([cfg.topic("control")])
        source.seek_to_beginning()
        with self.lock:
            self.status, self.events, self.lags, self.undecodable = clients.status, [], {}, 0
            self.broker = {"state": "connected", "bootstrap": cfg.kafka.bootstrap_servers, "error": ""}
        self._lags_at = 0.0
        return clients

    def _apply(self, status: RunStatus, message: ControlMessage) -> None:
        before = status.view.malformed
        status.apply(message)
        if status.view.malformed == before and message.kind in FLEET_EVENTS:
            self.events.append({"time": message.created_at, "kind": FLEET_EVENTS[message.kind],
                                "who": message.sender})

    def _count(self, record: Any, error: Exception) -> None:
        self.undecodable += 1

    def _set_broker(self, state: str, bootstrap: str, error: str) -> None:
        with self.lock:
            self.broker = {"state": state, "bootstrap": bootstrap, "error": error}

    def close(self) -> None:
        if self._clients is not None:
            for client in (self._clients.source, self._clients.admin):
                try:
                    client.close()
                except Exception:  # closing a client of a broker that is gone
                    pass
        self._clients = None
        self._bootstrap = ""


# --------------------------------------------------------------------------------------------------
# One run


class RunWatch:
    """One run: its directory's `config.yaml` (re-read when it changes; `fallback` until there is one) and
    `metrics.jsonl`, and its control topic. `start()` refreshes them from a background thread until `stop()`;
    `refresh()` does one round in the caller's thread (tests)."""

    def __init__(self, name: str, run_dir: Path, *, fallback: Config | None = None,
                 transport_for: Callable[[Config], Transport] = connect_for):
        self.name, self.run_dir, self.fallback = name, Path(run_dir), fallback
        self.metrics = MetricsTail(self.run_dir / "metrics.jsonl")
        self.control = ControlFollower(transport_for=transport_for)
        self._config: Config | None = None
        self._config_mtime: float | None = None
        self._config_error = ""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def config(self) -> Config | None:
        """The run's resolved config (`<run dir>/config.yaml`), else `fallback`; None when neither is there."""
        path = self.run_dir / "config.yaml"
        try:
            mtime = path.stat().st_mtime
        except FileNotFoundError:
            return self.fallback
        if mtime != self._config_mtime:
            self._config_mtime = mtime
            try:
                self._config, self._config_error = load_config(path), ""
            except (ConfigError, OSError, ValueError) as e:
                self._config, self._config_error = None, f"{path}: {e}"
        return self._config or self.fallback

    def refresh(self, *, poll_s: float = 1.0) -> None:
        self.metrics.read()
        self.control.step(self.config(), poll_s=poll_s)

    def start(self) -> RunWatch:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name=f"dashboard-{self.name}", daemon=True)
            self._thread.start()
        return self

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.refresh()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        self.control.close()

    def snapshot(self, *, since: int = 0, epoch: int | None = None, now: float | None = None) -> dict:
        """The run as JSON (module docstring). `records` holds the metrics records from index `since` on (all of
        them when `epoch` is not the file's current `records_epoch`): a stream sends each record once."""
        now = time.time() if now is None else now
        cfg = self.config()
        records, since, total, metrics_epoch, malformed_lines = self.metrics.view(since, epoch)
        with self.control.lock:
            status, broker = self.control.status, dict(self.control.broker)
            events, lags, undecodable = list(self.control.events), dict(self.control.lags), self.control.undecodable
            trainer = None if status is None else {
                **{k: v for k, v in vars(status.trainer).items() if k != "history"},
                "seconds_since_seen": now - status.trainer.last_seen if status.trainer.last_seen else None}
            explorers = [] if status is None else explorer_rows(status, now)
            throughput = {} if status is None else {"groups_per_s": status.groups_per_s(now),
                                                    "steps_per_s": status.steps_per_s(now)}
            malformed = 0 if status is None else status.view.malformed
        state = _run_state(trainer, explorers, has_metrics=total > 0, broker=broker["state"])
        return {
            "run": self.name, "dir": str(self.run_dir), "time": now, "state": state,
            "notices": _notices(self, cfg, state, broker), "broker": broker,
            "config": None if cfg is None else {"mode": cfg.run.mode, "max_staleness": cfg.run.max_staleness,
                                                "async_max_staleness": cfg.run.async_max_staleness,
                                                "max_steps": cfg.run.max_steps, "yaml": cfg.to_yaml()},
            "records": records, "records_offset": since, "records_total": total,
            "records_epoch": metrics_epoch,
            "trainer": trainer, "explorers": explorers, "fleet_events": events, "lags": lags,
            "throughput": throughput,
            "skipped": {"metrics_lines": malformed_lines, "control_undecodable": undecodable,
                        "control_malformed": malformed},
        }


def _run_state(trainer: dict | None, explorers: list[dict], *, has_metrics: bool, broker: str) -> str:
    if trainer is not None and trainer["state"] == "finished":
        return "finished"
    heard = trainer is not None and (trainer["state"] != "not started" or explorers)
    if broker == "connected" and heard:
        return "running"
    if has_metrics:
        return "running" if broker == "connected" else "ended"
    return "not-started"


def _notices(watch: RunWatch, cfg: Config | None, state: str, broker: dict) -> list[str]:
    """What the page says above the charts, in words."""
    notices = []
    if watch._config_error:
        notices.append(f"the run's config could not be read: {watch._config_error}")
    if state == "not-started":
        notices.append(f"run {watch.name!r} has not started yet: no metrics in {watch.metrics.path} and no control "
                       "message; this page updates when it starts")
    if broker["state"] == "unreachable":
        notices.append(f"the broker at {broker['bootstrap']} is unreachable ({broker['error']}); showing "
                       f"{watch.metrics.path.name} only" + (", and the fleet as last seen" if watch.control.status
                                                            else ""))
    elif broker["state"] == "embedded":
        notices.append("kafka.bootstrap_servers is 'embedded': the run's broker exists only while `rft run` runs, "
                       f"and {watch.run_dir / 'config.yaml'} does not name one yet")
    elif broker["state"] == "no-topic":
        notices.append(f"the broker at {broker['bootstrap']} has no control topic for run {watch.name!r} yet")
    elif broker["state"] == "no-config":
        notices.append(f"no config for run {watch.name!r} ({watch.run_dir / 'config.yaml'} does not exist): "
                       "no broker to ask")
    return notices


# --------------------------------------------------------------------------------------------------
# The runs of an output directory


class RunIndex:
    """The runs one dashboard shows: the config's own run, and every run directory beside it in `run.output_dir`
    (a directory with a `config.yaml` or a `metrics.jsonl`), stages included (`<run>/stages/<run>.<stage>`).
    Runs are watched (a background thread and a broker connection each) from the first time they are asked for
    until `close()`."""

    def __init__(self, cfg: Config, *, transport_for: Callable[[Config], Transport] = connect_for):
        self.cfg, self.transport_for = cfg, transport_for
        self.output_dir = Path(cfg.run.output_dir)
        self._watches: dict[str, RunWatch] = {}
        self._lock = threading.Lock()

    def run_dirs(self) -> dict[str, Path]:
        """Run name -> directory, the config's run first."""
        found = {self.cfg.run.name: self.cfg.run_dir}
        if self.output_dir.is_dir():
            for d in sorted(self.output_dir.iterdir()):
                for run_dir in (d, *sorted((d / "stages").glob("*"))):
                    if (run_dir / "config.yaml").is_file() or (run_dir / "metrics.jsonl").is_file():
                        found.setdefault(run_dir.name, run_dir)
        return found

    def runs(self) -> list[dict]:
        return [{"name": name, "dir": str(d), "default": name == self.cfg.run.name,
                 "has_metrics": (d / "metrics.jsonl").is_file()} for name, d in self.run_dirs().items()]

    def get(self, name: str) -> RunWatch | None:
        """The watched run `name` (started on first use); None when there is no such run."""
        with self._lock:
            if name not in self._watches:
                run_dir = self.run_dirs().get(name)
                if run_dir is None:
                    return None
                fallback = self.cfg if name == self.cfg.run.name else None
                self._watches[name] = RunWatch(name, run_dir, fallback=fallback,
                                               transport_for=self.transport_for).start()
            return self._watches[name]

    def close(self) -> None:
        with self._lock:
            watches, self._watches = list(self._watches.values()), {}
        for watch in watches:
            watch.stop()
