"""`rft chaos`: named fault scenarios against real `rft run`s, and a ledger of what was acknowledged and trained.

    rft chaos [--scenario NAME[+NAME] ...|--all] [--seed S] [--out DIR] [--quick]

Each scenario runs a short `rft run` (the tiny model of rft.models.tiny, the generated copy_char task, mode
off_policy with run.max_staleness 2, one experiences partition) on a local broker that outlives the run (a Tansu
`rft.broker.local.LocalBroker`; for the scenarios that need it, advertised behind `KafkaProxy`, a TCP proxy that every
client then goes through), injects its faults at moments drawn from a `random.Random` seeded by `--seed` and the
scenario's name, lets the run (restarted with the same `rft run` command where the fault ended it) finish its
`run.max_steps`, and builds the ledger (`build_ledger`) from the experiences topic, the dead-letter topic, the
trainer's consumed.jsonl, metrics.jsonl and final checkpoint. One table row per scenario is printed; each
scenario's ledger, faults and logs are written to `--out/<scenario>/` (`ledger.json`), the table to
`--out/chaos.json`. Exit status 0 when every scenario passed (0 lost, 0 trained twice, stall within the bound,
staleness bound held, the run finished), 1 otherwise.

The ledger (by group id; the experiences topic has one partition, so the trainer's take order is the log order):
  acknowledged  distinct group ids of this run on the experiences topic (what the broker holds: every record an
                explorer was acknowledged for is there; records whose acknowledgement was lost are there too)
  covered       those before the offsets of the trainer's final checkpoint (the run must reach max_steps)
  pending       acknowledged, after the final offsets (produced after the trainer took its last batch)
  trained       distinct group ids in consumed.jsonl (cut back to the resumed checkpoint on each resume)
  lost          covered, never trained, and not legitimately skipped where the trainer met it: each covered record
                is offered to the step of the next record the trainer took; it is skipped legitimately iff it does
                not decode (a dead letter), is another run's, repeats a group id already taken, or is outside the
                mode's staleness bound at that step (stale, or from a future version after a resume)
  foreign versions  groups (trained or skipped) of a policy version this run's trainer never published (above the
                newest step in metrics.jsonl + 1): made with another lineage's weights (a stale cache, a reused store,
                a forged announcement); never a legitimate skip, and the scenario fails
  duplicated    group ids in consumed.jsonl more than once
  dup records   records on the topic repeating a group id (producer retries, re-explored tasks after a kill)
  dead letters  undecodable covered records, each of which must be on the dead-letter topic (by `rft-origin`);
                poison tasks the explorers' group committed past must be there too
  longest stall the longest gap between two trainer steps of one `rft run` (the gap across a restart the tool
                made is not counted), against trainer.poll_timeout_s (after which the trainer gives up)
  staleness     the largest staleness trained (consumed.jsonl and metrics.jsonl), against run.max_staleness

A scenario named `A+B` runs A's and B's faults in one run (`combined`): the scenarios whose fault lasts the whole run
(`Scenario.arm`: producer-retries) are armed before the run starts and disarmed 2 steps before its end, while at most
one other drives the run as it does alone (a plain run if none); its topics and directories are named `A-and-B`.

Scenarios (`SCENARIOS`: data, name -> Scenario; adding one is adding an entry). How each fault is aimed:
  trainer-kill      SIGKILL of the trainer (all its processes), then the same `rft run` again, once per phase, in a
                    seeded order: `waiting` (exact: the explorers are SIGSTOPped until the trainer has announced
                    trainer_waiting for its next step on the control topic; SIGCONT after the kill), `checkpoint`
                    (a `checkpoints/step_N/` directory without its trainer_state.json, polled every 2 ms: inside
                    the model save or the state write), `publish` (a `weights/.tmp-*` directory, polled every 2 ms:
                    inside the store write of a version), `step` (approximate: a seeded 10-80 ms after a metrics line
                    whose consumer lag shows a full batch waiting, i.e. somewhere in the next step's read, training
                    or publish). A phase not seen within 60 s (checkpoint, publish: 150 s) is killed at once and
                    marked `(missed)`.
  explorer-kill     two extra `rft explorer` processes (besides the run's explorer-0), SIGKILLed and restarted with
                    the same id: `generation` (approximate: 0-50 ms after the proxy passed that explorer a fetch
                    response of more than 1 KiB, i.e. with tasks: between taking tasks and producing their groups)
                    and `publish` (exact: the proxy holds the broker's response to the explorer's produce request,
                    kills the explorer, then drops the response: the record is on the broker, unacknowledged).
  broker-stop       SIGSTOP of the broker for 1.5 x kafka.request_timeout_ms (set to 6 s here), then SIGCONT; twice.
  producer-retries  the proxy closes the connection instead of passing on the broker's response to an explorer's
                    produce request, with probability 0.25 (the broker wrote the records; the producer does not know
                    and retries).
  fleet-churn       every 2-5 s one extra `rft explorer` is started or stopped (SIGTERM or SIGKILL), 0 to 3 of them
                    besides explorer-0, on 2 task partitions (so at times more explorers than partitions).
  poison            at seeded moments, malformed (random bytes), foreign-schema (schema version 99; a task in the
                    experiences topic), NaN-reward, truncated and oversized (2 MiB) records are produced into the
                    tasks and experiences topics, and a well-formed group of another run into the experiences topic.
  broker-restart    kill -9 of the durable local broker (LocalBroker(data_dir=...): Tansu and its object store) at
                    seeded steps, down for 1-4 s, then started again on the same data directory and port; twice.
  claim-lost        records.claim_threshold_bytes 2, so every array of every group is claim-checked (the run's claim
                    store, a directory); at seeded steps the next new object the store receives (polled every 2 ms:
                    a part of a record being sent, not yet read) is deleted: that group is dead-lettered "missing"
                    (a legitimate dead letter, which must be on the dead-letter topic), unless a later record
                    re-put the same payload before the trainer read it.
  forged-control    at seeded steps, forged messages on the control topic: a `weights` announcement of version 10^8,
                    one 1000 versions ahead at a directory outside the weight store (a copy of the newest version),
                    and a `tasks_group` move to a far epoch that nobody seeded. Passes when the run finishes, no group
                    of a version the trainer never made is on the topic, no explorer logged loading a forged version
                    (its refusals, `weights_refused` in its heartbeats, are in the row), and no explorer committed
                    in the forged group.
  poisoned-cache    an S3 weight store (rft's object server) and a host cache in the scenario's directory; at seeded
                    steps the next 3 versions are planted in the cache as another lineage's (copies of the newest
                    cached version, their manifests naming another lineage and run). Passes when every planted version
                    was removed by the cache (its log line) rather than served, and the ledger balances.
  claim-slow        the same claim-checked records in an S3 claim store (rft's object server) behind a TCP proxy
                    (rft/broker/slow.py) that holds a seeded 10% of its answers for 2 s, past
                    records.fetch_timeout_s (1 s), and the others for 50 ms: reads and writes are retried
                    (records.fetch_retries 3); a group whose every attempt was slow is dead-lettered with the reason.

Claim-checked records (rft/transport/claims.py) are read by the ledger without their claims resolved (`offered`): a
part claim leaves the group's scalars in place, a whole-body stub keeps run_id and group_id. Such a record the trainer
skipped for no other reason is a legitimate dead letter (its parts could not be fetched) only if it is on the
dead-letter topic.
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import random
import re
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time
import uuid
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import msgpack
import numpy as np
import yaml

from benchmarks.runs import (
    consumed,
    latest_checkpoint_state,
    log_tail,
    no_process_left,
    read_topic,
    rft_explorer,
    rft_run,
    steps_done,
    write_config,
)
from rft.broker.local import LocalBroker
from rft.broker.objects import ObjectServer
from rft.broker.slow import SlowProxy
from rft.modes import staleness_bound
from rft.processes import free_port, kill_matching, matching, signal_group, stop_group
from rft.schema import (
    HEADER_SCHEMA,
    HEADER_TYPE,
    ControlMessage,
    ExperienceGroup,
    RecordError,
    Sample,
    TaskRecord,
    decode,
    decode_group,
    encode,
)
from rft.transport import TransportError, claims_in, connect
from rft.transport.base import HEADER_ORIGIN
from rft.transport.config import KafkaConfig
from rft.transport.control import TasksGroup, Weights
from rft.weights.store import LATEST, MANIFEST, version_dirname, version_of

PRODUCE, FETCH = 0, 1
MODE, MAX_STALENESS = "off_policy", 2


# --------------------------------------------------------------------------------------------------
# The ledger (pure: crafted inputs in tests/unit/test_chaos_ledger.py)


@dataclass(frozen=True)
class Offered:
    """One record of the experiences topic as the ledger sees it: `group_id` None when it does not decode."""
    offset: int
    group_id: str | None
    run_id: str | None = None
    policy_version: int | None = 0  # None: not known without resolving its claims (a whole-body stub)
    claimed: bool = False  # carries claims: the trainer may have dead-lettered it (a part it could not fetch)


@dataclass
class Ledger:
    acknowledged: int = 0
    covered: int = 0
    pending: int = 0
    trained: int = 0
    lost: list[str] = field(default_factory=list)
    duplicated: list[str] = field(default_factory=list)
    unmatched: list[str] = field(default_factory=list)  # trained, but not found in log order on the topic
    dup_records: int = 0
    foreign_versions: list[str] = field(default_factory=list)  # groups of a version the trainer never published
    skipped: dict[str, int] = field(default_factory=dict)  # reason -> records skipped legitimately (covered)
    dead_letter_offsets: list[int] = field(default_factory=list)  # covered records that do not decode
    staleness_max: int = 0
    staleness_min: int = 0

    @property
    def ok(self) -> bool:
        return not self.lost and not self.duplicated and not self.unmatched and not self.foreign_versions


def build_ledger(records: list[Offered], trained: list[dict], final_offset: int, *, run_id: str,
                 bound: int | None, newest_version: int | None = None) -> Ledger:
    """The ledger of the module docstring from the experiences topic's records in log order (one partition),
    consumed.jsonl's records in order, and the final checkpoint's next offset on that partition. `newest_version`:
    the newest version this run's trainer can have published (None: not checked); a group of a newer one is a
    foreign version, never a legitimate skip."""
    ledger = Ledger()

    def foreign(version: int | None) -> bool:
        return newest_version is not None and version is not None and version > newest_version

    ledger.foreign_versions = sorted({t["group_id"] for t in trained if foreign(t.get("policy_version"))})
    ids = [r.group_id for r in records if r.group_id is not None and r.run_id == run_id]
    ledger.acknowledged = len(set(ids))
    ledger.dup_records = len(ids) - len(set(ids))
    covered = [r for r in records if r.offset < final_offset]
    covered_ids = {r.group_id for r in covered if r.group_id is not None and r.run_id == run_id}
    ledger.covered = len(covered_ids)
    ledger.pending = len(set(ids) - covered_ids)
    counts = collections.Counter(t["group_id"] for t in trained)
    ledger.trained = len(counts)
    ledger.duplicated = sorted(g for g, n in counts.items() if n > 1)
    if trained:
        ledger.staleness_max = max(t["staleness"] for t in trained)
        ledger.staleness_min = min(t["staleness"] for t in trained)
    trained_ids, taken, skipped = set(counts), set(), collections.Counter()
    j = 0
    for r in covered:
        if j < len(trained) and r.group_id == trained[j]["group_id"] and r.group_id not in taken:
            taken.add(r.group_id)
            j += 1
            continue
        step = trained[min(j, len(trained) - 1)]["step"] if trained else 1  # the step this record was offered to
        if r.group_id is None:
            skipped["dead_letter"] += 1
            ledger.dead_letter_offsets.append(r.offset)
        elif r.claimed and r.group_id not in taken and r.group_id not in trained_ids and r.run_id == run_id \
                and not _outside(bound, step, r.policy_version):
            skipped["claim_dead_letter"] += 1  # its parts could not be fetched: legitimate only on the DLQ
            ledger.dead_letter_offsets.append(r.offset)
        elif r.run_id != run_id:
            skipped["foreign"] += 1
        elif foreign(r.policy_version):
            if r.group_id not in ledger.foreign_versions:
                ledger.foreign_versions.append(r.group_id)
        elif r.group_id in taken:
            skipped["duplicate"] += 1
        elif r.policy_version is not None and bound is not None and (step - 1) - r.policy_version > bound:
            skipped["stale"] += 1
        elif r.policy_version is not None and bound is not None and (step - 1) - r.policy_version < 0:
            skipped["future_version"] += 1
        elif r.group_id in trained_ids:
            skipped["taken_later"] += 1  # admissible here, taken at a later occurrence: not lost
        else:
            ledger.lost.append(r.group_id)
    ledger.unmatched = [t["group_id"] for t in trained[j:]]
    ledger.skipped = dict(skipped)
    return ledger


def _outside(bound: int | None, step: int, version: int | None) -> bool:
    """Whether a group of `version` is outside the mode's bound at `step` (unknown version: not known to be)."""
    return bound is not None and version is not None and not 0 <= (step - 1) - version <= bound


def longest_stall(step_times: list[float], restarts: list[float]) -> float:
    """The longest gap between consecutive step times (sorted) that contains no restart time."""
    times = sorted(step_times)
    gaps = [b - a for a, b in zip(times, times[1:], strict=False) if not any(a < r < b for r in restarts)]
    return round(max(gaps, default=0.0), 2)


# --------------------------------------------------------------------------------------------------
# A Kafka-protocol TCP proxy


class KafkaProxy:
    """Listens on 127.0.0.1:`port` and forwards every connection to `upstream` (host, port), reading the frames
    (4-byte size, then the request header: api_key, api_version, correlation_id, client_id). For each response,
    `on_response(client_id, api_key, response_bytes)` decides: True passes it on, False closes the client's
    connection instead (the request was served by the broker; the client never hears so). `events` counts
    (client_id, api_key) -> responses passed. Runs its own asyncio loop in a daemon thread."""

    def __init__(self, upstream: tuple[str, int], on_response: Callable[[str, int, int], bool] | None = None):
        self.upstream, self.on_response = upstream, on_response
        self.port = free_port()
        self.events: collections.Counter = collections.Counter()
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()

    def start(self) -> KafkaProxy:
        threading.Thread(target=self._serve, daemon=True, name="kafka-proxy").start()
        if not self._ready.wait(10):
            raise RuntimeError("the proxy did not start")
        return self

    def _serve(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_until_complete(asyncio.start_server(self._handle, "127.0.0.1", self.port))
        self._ready.set()
        self._loop.run_forever()

    def stop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)

    async def _handle(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        try:
            up_r, up_w = await asyncio.open_connection(*self.upstream)
        except OSError:
            client_w.close()
            return
        requests: dict[int, tuple[int, str]] = {}

        def abort() -> None:
            for w in (client_w, up_w):
                w.transport.abort()

        async def upstream() -> None:
            while True:
                head = await client_r.readexactly(4)
                body = await client_r.readexactly(struct.unpack(">i", head)[0])
                api_key, _, correlation = struct.unpack(">hhi", body[:8])
                n = struct.unpack(">h", body[8:10])[0]
                requests[correlation] = (api_key, body[10:10 + n].decode(errors="replace") if n > 0 else "")
                up_w.write(head + body)
                await up_w.drain()

        async def downstream() -> None:
            while True:
                head = await up_r.readexactly(4)
                body = await up_r.readexactly(struct.unpack(">i", head)[0])
                api_key, client = requests.pop(struct.unpack(">i", body[:4])[0], (-1, ""))
                if self.on_response is not None and not self.on_response(client, api_key, len(body)):
                    abort()
                    return
                self.events[(client, api_key)] += 1
                client_w.write(head + body)
                await client_w.drain()

        tasks = [asyncio.ensure_future(upstream()), asyncio.ensure_future(downstream())]
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        for t in tasks:
            t.cancel()
        abort()


class ChaosBroker(LocalBroker):
    """The local Tansu broker, optionally advertising another port (a proxy's) so that every client, after
    bootstrapping, connects there. `pid`: the broker process (for SIGSTOP / SIGCONT)."""

    def __init__(self, log_path: Path, advertised_port: int | None = None, data_dir: Path | None = None):
        super().__init__(log_path=log_path, data_dir=data_dir)
        self.advertised_port = advertised_port

    def command(self, s3: bool = False) -> list[str]:
        command = super().command(s3=s3)
        if self.advertised_port is not None:
            if "--advertised-listener-url" not in command:
                raise RuntimeError("the proxy needs the Tansu broker (unset KAFKA_HOME)")
            command[command.index("--advertised-listener-url") + 1] = f"tcp://{self.host}:{self.advertised_port}"
        return command

    @property
    def pid(self) -> int:
        return self._process.pid


# --------------------------------------------------------------------------------------------------
# One scenario's context


@dataclass
class Scenario:
    name: str
    inject: Callable[[Context], None]  # starts the run (ctx.start_run), injects faults while it runs
    proxy: bool = False  # clients through KafkaProxy (ctx.proxy, ctx.drop)
    config: dict = field(default_factory=dict)  # section -> overrides of the run config
    steps: int = 30  # run.max_steps (--quick: 16)
    durable: bool = False  # the broker keeps its topics on disk (LocalBroker(data_dir=...)) and can be killed
    # a fault that lasts the whole run: armed before the run starts, it returns its disarm (which records the faults
    # it made); such a scenario can share another's run (`combined`)
    arm: Callable[[Context], Callable[[], None]] | None = None

    @property
    def run(self) -> str:
        """The run's name: its topics' prefix and directory (a topic name takes no '+')."""
        return self.name.replace("+", "-and-")


class Context:
    """What a scenario's `inject` works with: the run (started, restarted), its files, the seeded `rng`, the
    proxy's response hook (`drop`), and `fault()` to record each fault injected."""

    def __init__(self, scenario: Scenario, out: Path, model: Path, seed: int, quick: bool):
        self.scenario, self.out, self.quick = scenario, out, quick
        self.rng = random.Random(seed * 1_000_003 + zlib.crc32(scenario.name.encode()))
        self.faults: list[dict] = []
        self.restarts: list[float] = []
        self.started = time.time()
        self.log = out / "run.log"
        self.drop: Callable[[str, int, int], bool] | None = None  # the proxy's hook: False drops a response
        self.proxy = None
        if scenario.proxy:
            self.broker = ChaosBroker(out / "broker.log", advertised_port=free_port())
            self.proxy = KafkaProxy(("127.0.0.1", self.broker.port), on_response=self._on_response)
            self.proxy.port = self.broker.advertised_port
        else:
            self.broker = ChaosBroker(out / "broker.log", data_dir=out / "broker-data" if scenario.durable else None)
        self.broker.start()
        if self.proxy is not None:
            self.proxy.start()
        self.bootstrap = f"127.0.0.1:{self.proxy.port}" if self.proxy else self.broker.bootstrap_servers
        self.steps = 16 if quick else scenario.steps
        sections = {k: dict(v) for k, v in scenario.config.items()}
        sections.setdefault("run", {}).update(mode=MODE, max_staleness=MAX_STALENESS, max_steps=self.steps)
        sections.setdefault("kafka", {}).update(bootstrap_servers=self.bootstrap)
        self.config = write_config(out, model, scenario.run, **sections)
        self.run_dir = out / "runs" / scenario.run
        self.process: subprocess.Popen | None = None
        self.explorers: dict[str, subprocess.Popen] = {}
        self.cleanup: list[Callable[[], None]] = []  # what a scenario started beside the run (closed last)

    def _on_response(self, client: str, api_key: int, size: int) -> bool:
        hook = self.drop
        return True if hook is None else hook(client, api_key, size)

    def fault(self, kind: str, **detail) -> None:
        self.faults.append({"t": round(time.time() - self.started, 2), "kind": kind, "step": self.step(), **detail})
        print(f"[chaos] {self.scenario.name}: {kind} {detail} at step {self.step()}", flush=True)

    def step(self) -> int:
        return max((m["step"] for m in steps_done(self.run_dir)), default=0)

    # -- the run
    def start_run(self) -> subprocess.Popen:
        if self.process is not None:
            self.restarts.append(time.time())
        self.process = rft_run(self.config, self.log)
        return self.process

    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def wait_for_step(self, step: int, timeout_s: float = 300) -> bool:
        """Until the trainer logged `step`; False if the run ended first (or timed out)."""
        deadline = time.monotonic() + timeout_s
        while self.step() < step:
            if not self.running() or time.monotonic() > deadline:
                return False
            time.sleep(0.2)
        return True

    def wait_exit(self, timeout_s: float = 600) -> int:
        try:
            return self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            signal_group(self.process, signal.SIGKILL)
            return self.process.wait()

    def run_config_path(self) -> Path:
        """The run's resolved config (written by `rft run`), what `rft explorer` joins with."""
        path = self.run_dir / "config.yaml"
        deadline = time.monotonic() + 120
        while not path.exists():
            if time.monotonic() > deadline:
                raise RuntimeError(f"{path} did not appear:\n{log_tail(self.log)}")
            time.sleep(0.2)
        return path

    def trainer_pids(self) -> list[int]:
        return matching("rft.cli trainer", str(self.run_dir / "config.yaml"))

    def explorer_pids(self, explorer_id: str | None = None) -> list[int]:
        needles = ("rft.cli explorer", str(self.run_dir / "config.yaml"))
        return matching(*needles, *(("--explorer-id", explorer_id) if explorer_id else ()))

    def kill_trainer(self) -> None:
        kill_matching("rft.cli trainer", str(self.run_dir / "config.yaml"))

    def start_explorer(self, explorer_id: str) -> None:
        self.explorers[explorer_id] = rft_explorer(self.run_config_path(), explorer_id,
                                                   self.out / f"{explorer_id}.log")

    def stop_explorer(self, explorer_id: str, sig: int = signal.SIGTERM) -> None:
        process = self.explorers.pop(explorer_id)
        stop_group(process, sig, timeout_s=60)

    def close(self) -> None:
        for explorer_id in list(self.explorers):
            self.stop_explorer(explorer_id)
        if self.running():
            signal_group(self.process, signal.SIGKILL)
        if self.proxy is not None:
            self.proxy.stop()
        self.broker.stop()
        for close in reversed(self.cleanup):
            close()

    def finish(self) -> int:
        """Wait for the current `rft run`; while it ends in failure after a trainer the scenario killed, or ends
        without the trainer reaching max_steps, start it again (at most 3 times). The final exit status."""
        code = self.wait_exit()
        for _ in range(3):
            if code == 0 and self.step() >= self.steps:
                break
            print(f"[chaos] {self.scenario.name}: rft run ended with {code} at step {self.step()}; running it again",
                  flush=True)
            self.fault("run_restart_needed", exit=code)
            self.start_run()
            code = self.wait_exit()
        return code


# --------------------------------------------------------------------------------------------------
# Scenarios


def poll_until(condition: Callable[[], object], timeout_s: float, every_s: float) -> object:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = condition()
        if found:
            return found
        time.sleep(every_s)
    return None


def trainer_waiting_for(ctx: Context, version: int) -> bool:
    """Whether the current trainer announced it waits for data for step `version` + 1."""
    since = ctx.restarts[-1] if ctx.restarts else ctx.started
    for m in read_topic(ctx.bootstrap, f"{ctx.scenario.run}.control"):
        try:
            record = decode(m.value, m.headers)
        except RecordError:
            continue
        if (isinstance(record, ControlMessage) and record.kind == "trainer_waiting"
                and record.body.get("version") == version and record.created_at > since):
            return True
    return False


def kill_trainer_at(ctx: Context, phase: str) -> None:
    """SIGKILL the trainer in `phase` (see the module docstring for how each is aimed)."""
    run_dir = ctx.run_dir
    if phase == "waiting":
        explorers = ctx.explorer_pids()
        for pid in explorers:
            os.kill(pid, signal.SIGSTOP)
        try:
            def starved() -> bool:
                before = ctx.step()
                time.sleep(1.0)
                return ctx.step() == before and trainer_waiting_for(ctx, ctx.step())
            seen = poll_until(starved, 60, 0.1)
            ctx.kill_trainer()
        finally:
            for pid in explorers:
                try:
                    os.kill(pid, signal.SIGCONT)
                except ProcessLookupError:
                    pass
    elif phase == "step":
        def batch_ready() -> bool:
            metrics = steps_done(run_dir)
            return bool(metrics) and (metrics[-1].get("consumer_lag") or 0) >= 4 and metrics[-1]["step"] > seen_at
        seen_at = ctx.step()
        seen = poll_until(batch_ready, 60, 0.005)
        time.sleep(ctx.rng.uniform(0.01, 0.08))
        ctx.kill_trainer()
    elif phase == "checkpoint":
        def in_checkpoint() -> bool:
            dirs = (run_dir / "checkpoints").glob("step_*")
            return any(not (d / "trainer_state.json").exists() for d in dirs)
        seen = poll_until(in_checkpoint, 150, 0.002)
        ctx.kill_trainer()
    elif phase == "publish":
        seen = poll_until(lambda: any((run_dir / "weights").glob(".tmp-*")), 150, 0.002)
        ctx.kill_trainer()
    else:
        raise ValueError(phase)
    ctx.fault("trainer_sigkill", phase=phase if seen else f"{phase} (missed)")


def inject_trainer_kill(ctx: Context) -> None:
    phases = ["waiting", "step", "checkpoint", "publish"]
    ctx.rng.shuffle(phases)
    if ctx.quick:
        phases = phases[:1]
    for phase in phases:
        ctx.start_run()
        ctx.wait_for_step(ctx.step() + ctx.rng.randint(2, 4))
        if not ctx.running() or ctx.step() >= ctx.steps - 2:
            break
        kill_trainer_at(ctx, phase)
        code = ctx.wait_exit(120)
        if not no_process_left("rft.cli trainer", str(ctx.run_dir / "config.yaml")):
            ctx.fault("trainer_survived_kill")
        print(f"[chaos] rft run ended with {code}", flush=True)
    ctx.start_run()


def explorer_killer(ctx: Context, kind: str, victim: str, killed: threading.Event
                    ) -> tuple[Callable[[], None], Callable[[str, int, int], bool]]:
    """(kill, hook): `kill` SIGKILLs explorer `victim` and sets `killed`; `hook`, the proxy's, calls it at the
    moment `kind` names (the scenario's `publish` or `generation`)."""

    def kill() -> None:
        for pid in ctx.explorer_pids(victim):
            os.kill(pid, signal.SIGKILL)
        killed.set()

    if kind == "publish":
        def hook(client: str, api_key: int, size: int) -> bool:
            if client == victim and api_key == PRODUCE and not killed.is_set():
                kill()
                return False  # the response to the produce the explorer was waiting for: never delivered
            return True
    else:
        def hook(client: str, api_key: int, size: int) -> bool:
            if client == victim and api_key == FETCH and size > 1024 and not killed.is_set():
                threading.Timer(ctx.rng.uniform(0.0, 0.05), kill).start()
            return True
    return kill, hook


def inject_explorer_kill(ctx: Context) -> None:
    ctx.start_run()
    ids = ["x1", "x2"]
    for explorer_id in ids:
        ctx.start_explorer(explorer_id)
    kinds = ["generation", "publish"] * (1 if ctx.quick else 2)
    ctx.rng.shuffle(kinds)
    for kind in kinds:
        if not ctx.wait_for_step(ctx.step() + ctx.rng.randint(1, 3)) or ctx.step() >= ctx.steps - 3:
            break
        victim = ctx.rng.choice(ids)
        killed = threading.Event()
        kill, hook = explorer_killer(ctx, kind, victim, killed)
        ctx.drop = hook
        exact = killed.wait(60)
        ctx.drop = None
        if not exact:
            kill()
        ctx.explorers[victim].wait(timeout=30)
        ctx.fault("explorer_sigkill", explorer=victim, phase=kind if exact else f"{kind} (missed)")
        ctx.start_explorer(victim)


def inject_broker_stop(ctx: Context) -> None:
    ctx.start_run()
    request_timeout_s = ctx.scenario.config["kafka"]["request_timeout_ms"] / 1000
    for _ in range(1 if ctx.quick else 2):
        if not ctx.wait_for_step(ctx.step() + ctx.rng.randint(2, 5)) or ctx.step() >= ctx.steps - 3:
            break
        stopped_s = round(1.5 * request_timeout_s + ctx.rng.uniform(0, 2), 1)
        os.kill(ctx.broker.pid, signal.SIGSTOP)
        ctx.fault("broker_sigstop", seconds=stopped_s)
        time.sleep(stopped_s)
        os.kill(ctx.broker.pid, signal.SIGCONT)


def inject_broker_restart(ctx: Context) -> None:
    """kill -9 of the durable broker (Tansu and its object store) at seeded steps, down for 1-4 s, then started
    again on the same data and port: every record it acknowledged must still be there, once."""
    ctx.start_run()
    for _ in range(1 if ctx.quick else 2):
        if not ctx.wait_for_step(ctx.step() + ctx.rng.randint(2, 5)) or ctx.step() >= ctx.steps - 3:
            break
        down_s = round(ctx.rng.uniform(1, 4), 1)
        ctx.broker.kill()
        ctx.fault("broker_kill9", seconds_down=down_s)
        time.sleep(down_s)
        ctx.broker.start()


def arm_producer_retries(ctx: Context) -> Callable[[], None]:
    dropped = collections.Counter()

    def hook(client: str, api_key: int, size: int) -> bool:
        if client.startswith("explorer-") and api_key == PRODUCE and ctx.rng.random() < 0.25:
            dropped[client] += 1
            return False
        return True

    def disarm() -> None:
        ctx.drop = None
        for client, n in sorted(dropped.items()):
            for _ in range(n):
                ctx.fault("produce_response_dropped", explorer=client)

    ctx.drop = hook
    return disarm


def run_armed(ctx: Context) -> None:
    """A plain run, for the faults armed around it (`Scenario.arm`)."""
    ctx.start_run()


def inject_fleet_churn(ctx: Context) -> None:
    ctx.start_run()
    ctx.run_config_path()
    serial = 0
    while ctx.running() and ctx.step() < ctx.steps - 2:
        time.sleep(ctx.rng.uniform(2, 5))
        live = sorted(ctx.explorers)
        if live and (len(live) >= 3 or ctx.rng.random() < 0.4):
            victim = ctx.rng.choice(live)
            sig = ctx.rng.choice([signal.SIGTERM, signal.SIGKILL])
            ctx.stop_explorer(victim, sig)
            ctx.fault("explorer_stop", explorer=victim, signal=signal.Signals(sig).name)
        else:
            serial += 1
            ctx.start_explorer(f"c{serial}")
            ctx.fault("explorer_start", explorer=f"c{serial}", fleet=len(ctx.explorers) + 1)


def poison_records(run: str, rng: random.Random) -> list[tuple[str, str, bytes, list]]:
    """(topic kind, what, value, headers): records no explorer or trainer may take, and one foreign group."""
    task_value, task_headers = encode(TaskRecord(run_id=run, task_id="poison", epoch=0, prompt="x"))
    sample = Sample(sample_index=0, prompt_tokens=np.array([1, 2]), response_tokens=np.array([3]),
                    logprobs=np.array([-0.5]), loss_mask=np.array([1]), reward=float("nan"))
    nan_value, group_headers = encode(ExperienceGroup(run_id=run, task_id="poison", group_id=f"{run}/poison/e0",
                                                      attempt=0, explorer_id="chaos", policy_version=0,
                                                      samples=[sample]))
    good = Sample(sample_index=0, prompt_tokens=np.array([1, 2]), response_tokens=np.array([3]),
                  logprobs=np.array([-0.5]), loss_mask=np.array([1]), reward=1.0)
    foreign_value, _ = encode(ExperienceGroup(run_id="another-run", task_id="t", group_id="another-run/t/e0",
                                              attempt=0, explorer_id="chaos", policy_version=0, samples=[good]))
    foreign_schema = [(HEADER_SCHEMA, b"99"), (HEADER_TYPE, b"experience")]
    junk = bytes(rng.getrandbits(8) for _ in range(64))
    return [
        ("tasks", "malformed", junk, task_headers),
        ("tasks", "foreign-schema", task_value, [(HEADER_SCHEMA, b"99"), (HEADER_TYPE, b"task")]),
        ("tasks", "truncated", task_value[:len(task_value) // 2], task_headers),
        ("tasks", "oversized", b"\x00" * (2 << 20), task_headers),
        ("experiences", "malformed", junk, group_headers),
        ("experiences", "foreign-schema", nan_value, foreign_schema),
        ("experiences", "task-as-group", task_value, task_headers),
        ("experiences", "nan-reward", nan_value, group_headers),
        ("experiences", "truncated", foreign_value[:len(foreign_value) // 2], group_headers),
        ("experiences", "oversized", b"\x01" * (2 << 20), group_headers),
        ("experiences", "foreign-run", foreign_value, group_headers),
    ]


def inject_poison(ctx: Context) -> None:
    ctx.start_run()
    name = ctx.scenario.run
    # a foreign producer: it sends records over rft's kafka.max_record_bytes, as far as the broker takes them
    sink = connect(KafkaConfig(max_record_bytes=4 << 20), ctx.bootstrap).sink(client_id="chaos-poison", linger_ms=0)
    try:
        for _ in range(1 if ctx.quick else 3):
            if not ctx.wait_for_step(ctx.step() + ctx.rng.randint(2, 5)) or ctx.step() >= ctx.steps - 3:
                break
            records = poison_records(name, ctx.rng)
            ctx.rng.shuffle(records)
            for kind, what, value, headers in records:
                try:
                    meta = sink.send(f"{name}.{kind}", value, headers=headers, check_size=False).get(timeout=60)
                except TransportError as e:  # e.g. larger than the broker takes: nothing reached the topic
                    ctx.fault("poison_refused", topic=kind, what=what, error=str(e)[:200])
                    continue
                ctx.fault("poison", topic=kind, what=what, offset=meta.offset, partition=meta.partition)
    finally:
        sink.close()


CLAIMED = {"claim_threshold_bytes": 2}  # every array of the tiny run's groups (a few tokens: 4+ bytes) is claim-checked


def inject_claim_lost(ctx: Context) -> None:
    ctx.start_run()
    store = ctx.run_dir / "weights" / "records"
    for _ in range(2 if ctx.quick else 4):
        if not ctx.wait_for_step(ctx.step() + ctx.rng.randint(2, 4)) or ctx.step() >= ctx.steps - 3:
            break
        known = set(store.rglob("*"))
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # the next new object: a record being sent now, not yet read
            fresh = [f for f in store.rglob("*") if f.is_file() and f not in known]
            if fresh:
                fresh[0].unlink(missing_ok=True)
                ctx.fault("claim_deleted", object=fresh[0].name[:16])
                break
            time.sleep(0.002)


SLOW_S, SLOW_FRACTION, FETCH_TIMEOUT_S = 2.0, 0.1, 1.0


def s3_credentials() -> None:
    """Credentials for rft's object server (it checks none), inherited by the run's processes."""
    for key, value in {"AWS_ACCESS_KEY_ID": "rft-chaos", "AWS_SECRET_ACCESS_KEY": "rft-chaos",
                       "AWS_REGION": "us-east-1"}.items():
        os.environ.setdefault(key, value)


FORGED_EPOCH = 1_000_000  # the forged tasks_group's epoch: a consumer group nobody seeded (re-explore from the start)
FORGED_AHEAD = 1000  # the forged announcement outside the store is this many versions ahead of LATEST
FORGER = "chaos-forger"


def inject_forged_control(ctx: Context) -> None:
    """Forged control messages at seeded steps (module docstring, forged-control)."""
    ctx.start_run()
    name, store = ctx.scenario.run, ctx.run_dir / "weights"
    sink = connect(KafkaConfig(), ctx.bootstrap).sink(client_id=FORGER, linger_ms=0)
    try:
        for i in range(1 if ctx.quick else 2):
            if not ctx.wait_for_step(ctx.step() + ctx.rng.randint(2, 4)) or ctx.step() >= ctx.steps - 3:
                break
            version = int((store / LATEST).read_text())
            ahead = version + FORGED_AHEAD  # newer than anything the trainer announces meanwhile: tried first
            fake = ctx.out / f"forged-{i}" / version_dirname(ahead)
            try:  # a real version's files, at a directory outside the store
                shutil.copytree(store / version_dirname(version), fake)
            except OSError:
                fake.mkdir(parents=True, exist_ok=True)  # collected meanwhile: an empty directory is forged too
            # the huge version last, a step later: announced, it would hide the one outside the store (lower)
            forged = [("weights_outside_store", Weights(version=ahead, path=str(fake))),
                      ("tasks_group_far_epoch", TasksGroup(explorer_id=FORGER, group=f"{name}.explorers.{FORGED_EPOCH}",
                                                           epoch=FORGED_EPOCH, offsets={})),
                      ("weights_huge_version", Weights(version=10**8, path=str(store / "v100000000")))]
            for what, kind in forged:
                if what == "weights_huge_version":
                    ctx.wait_for_step(ctx.step() + 1)
                meta = sink.send_record(f"{name}.control", kind.to_message()).get(timeout=60)
                ctx.fault("forged", what=what, offset=meta.offset, version=getattr(kind, "version", None))
    finally:
        sink.close()


LOADED = re.compile(r"loaded weights version (\d+)")


def loaded_versions(logs: list[Path]) -> set[int]:
    """The versions the explorers logged as loaded (rft.weights.subscriber, rft.explorer)."""
    return {int(m.group(1)) for log in logs for m in LOADED.finditer(log.read_text(errors="replace"))}


def heartbeat_refusals(bootstrap: str, name: str) -> int:
    """The largest `weights_refused` any explorer reported in its heartbeats on the run's control topic."""
    refused = 0
    for m in read_topic(bootstrap, f"{name}.control"):
        try:
            record = decode(m.value, m.headers)
        except RecordError:
            continue
        if isinstance(record, ControlMessage) and record.kind == "explorer_heartbeat":
            value = record.body.get("weights_refused")
            if isinstance(value, int):
                refused = max(refused, value)
    return refused


def forgery_problems(faults: list[dict], *, loaded: set[int],
                     forged_group_committed: dict[str, int | None]) -> list[str]:
    """What the forged-control scenario's run shows of its forgeries being obeyed (empty: each was ignored): a forged
    version an explorer loaded (`loaded`: from its log), the forged tasks group committed in."""
    forged = [f for f in faults if f["kind"] == "forged"]
    problems = [f"an explorer loaded the forged weights version {f['version']} ({f['what']})" for f in forged
                if f.get("version") is not None and f["version"] in loaded]
    if any(f["what"] == "tasks_group_far_epoch" for f in forged) and \
            any(v is not None for v in forged_group_committed.values()):
        problems.append(f"explorers followed the forged tasks_group (committed in it: {forged_group_committed})")
    return problems


def inject_poisoned_cache(ctx: Context) -> None:
    """An S3 weight store and a host cache in the scenario's directory; at seeded steps, another lineage's versions are
    planted in the cache (module docstring, poisoned-cache)."""
    server = ObjectServer(ctx.out / "s3")
    ctx.cleanup.append(server.stop)
    server.bucket("weights")
    s3_credentials()
    config = yaml.safe_load(ctx.config.read_text())
    config.setdefault("sync", {}).update(weight_store=f"s3://weights/{ctx.scenario.run}", s3_endpoint=server.endpoint,
                                         cache_dir=str(ctx.out / "cache"))
    ctx.config.write_text(yaml.safe_dump(config))
    ctx.start_run()
    for _ in range(1 if ctx.quick else 2):
        if not ctx.wait_for_step(ctx.step() + ctx.rng.randint(2, 4)) or ctx.step() >= ctx.steps - 3:
            break
        plant_foreign_versions(ctx, ctx.out / "cache", count=3)


def plant_foreign_versions(ctx: Context, cache: Path, count: int) -> None:
    """Put the `count` versions after the newest cached one into the host cache as another lineage's: copies of the
    newest, their manifests naming that version, another lineage and run (what a stale cache of another run holds)."""
    cached = [d for d in cache.glob("*/v*") if version_of(d) is not None]
    if not cached:
        ctx.fault("cache_plant_skipped", why="no version cached yet")
        return
    newest = max(cached, key=lambda d: version_of(d) or 0)
    lineage, base = uuid.uuid4().hex, version_of(newest) or 0
    for version in range(base + 1, base + 1 + count):
        staged = ctx.out / f"plant-{version_dirname(version)}-{lineage[:8]}"
        try:
            shutil.copytree(newest, staged)
            manifest = json.loads((staged / MANIFEST).read_text())
            manifest.pop("delta", None)
            manifest.update(version=version, lineage=lineage, run="chaos-foreign-run")
            (staged / MANIFEST).write_text(json.dumps(manifest))
            os.rename(staged, newest.parent / version_dirname(version))
        except OSError as e:  # the newest was collected, or this version built, meanwhile
            shutil.rmtree(staged, ignore_errors=True)
            ctx.fault("cache_plant_skipped", version=version, why=str(e)[:200])
            continue
        ctx.fault("cache_planted", version=version)


CACHE_REMOVED = re.compile(r"weights cache: version (\d+) in .*? is of lineage")


def cache_removals(logs: list[Path]) -> set[int]:
    """The versions the host caches logged as removed for being of another lineage (rft.weights.cache)."""
    removed: set[int] = set()
    for log in logs:
        removed.update(int(m.group(1)) for m in CACHE_REMOVED.finditer(log.read_text(errors="replace")))
    return removed


def poisoned_cache_problems(faults: list[dict], removed: set[int]) -> list[str]:
    """The planted versions no cache removed (it may have served them): empty when every one was refused."""
    planted = [f["version"] for f in faults if f["kind"] == "cache_planted"]
    return [f"planted version {v} was not removed from the host cache" for v in planted if v not in removed]


def inject_claim_slow(ctx: Context) -> None:
    """An S3 claim store behind a proxy that holds a seeded share of its connections' answers (module docstring)."""
    server = ObjectServer(ctx.out / "s3")
    ctx.cleanup.append(server.stop)
    server.bucket("claims")
    rng = random.Random(ctx.rng.random())

    def delay(n: int) -> float:
        if rng.random() < SLOW_FRACTION:
            ctx.fault("claim_store_slow", answer=n, seconds=SLOW_S)
            return SLOW_S
        return 0.05

    proxy = SlowProxy(("127.0.0.1", int(server.endpoint.rpartition(":")[2])), delay)
    ctx.cleanup.append(proxy.close)
    s3_credentials()
    config = yaml.safe_load(ctx.config.read_text())
    config.setdefault("records", {}).update(store="s3://claims/records", s3_endpoint=f"http://{proxy.address}")
    ctx.config.write_text(yaml.safe_dump(config))
    ctx.start_run()


SCENARIOS: dict[str, Scenario] = {s.name: s for s in (
    Scenario("trainer-kill", inject_trainer_kill, steps=40),
    Scenario("explorer-kill", inject_explorer_kill, proxy=True, config={"explorer": {"replicas": 1}}),
    Scenario("broker-stop", inject_broker_stop, config={"kafka": {"request_timeout_ms": 6000}}),
    Scenario("producer-retries", run_armed, proxy=True, arm=arm_producer_retries),
    Scenario("fleet-churn", inject_fleet_churn, steps=60, config={"explorer": {"replicas": 1}}),
    # curriculum publishes tasks online (data.tasks_ahead), so the explorers reach the poison tasks
    Scenario("poison", inject_poison, config={"data": {"selector": "curriculum"}}),
    Scenario("broker-restart", inject_broker_restart, durable=True),
    Scenario("claim-lost", inject_claim_lost, config={"records": CLAIMED}),
    Scenario("claim-slow", inject_claim_slow, config={"records": {
        **CLAIMED, "fetch_retries": 3, "fetch_timeout_s": FETCH_TIMEOUT_S}}),
    Scenario("forged-control", inject_forged_control),
    Scenario("poisoned-cache", inject_poisoned_cache),
)}


def combined(name: str) -> Scenario:
    """The scenario `name` as it runs: one of SCENARIOS, or `A+B[+...]`, their faults in one run (module docstring).
    ValueError for an unknown part, or for two parts that each drive their run."""
    parts = []
    for part in name.split("+"):
        if part not in SCENARIOS:
            raise ValueError(f"unknown scenario {part!r} (known: {', '.join(sorted(SCENARIOS))})")
        parts.append(SCENARIOS[part])
    if len(parts) == 1 and parts[0].arm is None:
        return parts[0]
    drivers = [s for s in parts if s.arm is None]
    if len(drivers) > 1:
        raise ValueError(f"{name}: {' and '.join(s.name for s in drivers)} each drive their own run; "
                         "only scenarios that last the whole run (producer-retries) combine with one that does")
    armed = [s for s in parts if s.arm is not None]
    drive = drivers[0].inject if drivers else run_armed

    def inject(ctx: Context) -> None:
        disarms = [s.arm(ctx) for s in armed]
        try:
            drive(ctx)
            ctx.wait_for_step(ctx.steps - 2, timeout_s=600)
        finally:
            for disarm in disarms:
                disarm()

    config: dict = {}
    for s in parts:
        for section, overrides in s.config.items():
            config.setdefault(section, {}).update(overrides)
    return Scenario(name, inject, proxy=any(s.proxy for s in parts), config=config,
                    steps=max(s.steps for s in parts), durable=any(s.durable for s in parts))


# --------------------------------------------------------------------------------------------------
# Running a scenario and reading its ledger


def offered(bootstrap: str, topic: str) -> list[Offered]:
    records = []
    for m in read_topic(bootstrap, topic):
        if m.partition != 0:
            raise RuntimeError(f"{topic} has more than one partition: the ledger needs one (log order = take order)")
        records.append(offer(m.offset, m.value, m.headers))
    return records


def offer(offset: int, value: bytes, headers: list) -> Offered:
    """One record as the ledger sees it; a claim-checked one read without resolving its claims (module docstring)."""
    try:
        if claims_in(value):
            body = msgpack.unpackb(value, raw=False, strict_map_key=False)
            version = body.get("policy_version")
            if not (isinstance(body.get("group_id"), str) and isinstance(body.get("run_id"), str)):
                raise RecordError("a claimed record without run_id and group_id")
            return Offered(offset, body["group_id"], body["run_id"], version if isinstance(version, int) else None,
                           claimed=True)
        g = decode_group(value, headers)
        return Offered(offset, g.group_id, g.run_id, g.policy_version)
    except (RecordError, ValueError, AttributeError):
        return Offered(offset, None)


def dead_letter_origins(bootstrap: str, topic: str) -> set[str]:
    return {dict(m.headers).get(HEADER_ORIGIN, b"").decode() for m in read_topic(bootstrap, topic)}


def run_scenario(scenario: Scenario, out: Path, model: Path, seed: int, quick: bool) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    started = time.time()
    ctx = Context(scenario, out, model, seed, quick)
    row: dict = {"scenario": scenario.name}
    try:
        scenario.inject(ctx)
        code = ctx.finish()
        for explorer_id in list(ctx.explorers):
            ctx.stop_explorer(explorer_id)
        name, bootstrap = scenario.run, ctx.bootstrap
        state = latest_checkpoint_state(ctx.run_dir) or {"step": 0, "feed": {"offsets": {}}}
        final = state["feed"]["offsets"].get(f"{name}.experiences:0", 0)
        records = offered(bootstrap, f"{name}.experiences")
        trained = consumed(ctx.run_dir)
        metrics = steps_done(ctx.run_dir)
        newest = max((m["step"] for m in metrics), default=0) + 1  # a version is published before its metrics line
        ledger = build_ledger(records, trained, final, run_id=name,
                              bound=staleness_bound(MODE, MAX_STALENESS), newest_version=newest)
        origins = dead_letter_origins(bootstrap, f"{name}.dead_letter")
        missing_dlq = [o for o in ledger.dead_letter_offsets if f"{name}.experiences:0@{o}" not in origins]
        poison_tasks = [f for f in ctx.faults if f["kind"] == "poison" and f["topic"] == "tasks"]
        committed = tasks_committed(bootstrap, name)
        reached = [f for f in poison_tasks if f["offset"] < committed.get(f"{name}.tasks:{f['partition']}", 0)]
        tasks_missing_dlq = [f["what"] for f in reached
                             if f"{name}.tasks:{f['partition']}@{f['offset']}" not in origins]
        stall = longest_stall([m["time"] for m in metrics], ctx.restarts)
        poll_timeout = float(yaml.safe_load(ctx.config.read_text())["trainer"]["poll_timeout_s"])  # the run's own
        metrics_staleness = max((m.get("staleness_max", 0) for m in metrics), default=0)
        bound = MAX_STALENESS
        staleness_held = max(ledger.staleness_max, metrics_staleness) <= bound and ledger.staleness_min >= 0
        faults = [f for f in ctx.faults if f["kind"] not in ("run_restart_needed", "cache_plant_skipped")]
        problems = []
        logs = sorted((ctx.run_dir / "logs").glob("*.log")) + sorted(out.glob("*.log"))  # the parts' and explorers'
        if any(f["kind"] == "forged" for f in faults):
            committed_forged = committed_offsets(bootstrap, f"{name}.explorers.{FORGED_EPOCH}", f"{name}.tasks")
            problems += forgery_problems(faults, loaded=loaded_versions(logs),
                                         forged_group_committed=committed_forged)
            row["weights_refused"] = heartbeat_refusals(bootstrap, name)  # the explorers' count (informational)
        if any(f["kind"] == "cache_planted" for f in faults):
            problems += poisoned_cache_problems(faults, cache_removals(logs))
        finished = code == 0 and state["step"] == ctx.steps
        row.update({
            "faults": len(faults), "acknowledged": ledger.acknowledged, "trained": ledger.trained,
            "pending": ledger.pending, "lost": len(ledger.lost), "duplicated": len(ledger.duplicated),
            "unmatched": len(ledger.unmatched), "dup_records": ledger.dup_records, "skipped": ledger.skipped,
            "foreign_versions": len(ledger.foreign_versions), "problems": problems,
            "dead_letters": len(ledger.dead_letter_offsets), "dead_letters_missing": len(missing_dlq),
            "poison_tasks_reached": len(reached), "poison_tasks_missing": tasks_missing_dlq,
            "longest_stall_s": stall, "stall_bound_s": poll_timeout, "staleness_max": ledger.staleness_max,
            "staleness_bound": bound, "staleness_held": staleness_held, "finished": finished, "exit": code,
            "restarts": len(ctx.restarts), "final_step": state["step"], "wall_s": round(time.time() - started, 1),
        })
        row["passed"] = (finished and ledger.ok and not missing_dlq and not tasks_missing_dlq and not problems
                         and stall <= poll_timeout and staleness_held and len(faults) > 0)
        (out / "ledger.json").write_text(json.dumps({
            **row, "faults_injected": ctx.faults, "lost_ids": ledger.lost, "duplicated_ids": ledger.duplicated,
            "unmatched_ids": ledger.unmatched}, indent=1))
        if not finished:
            print(f"[chaos] {name}: the run did not finish:\n{log_tail(ctx.log)}", flush=True)
    except Exception as e:  # one scenario's failure is its row; the others still run
        row.update({"passed": False, "error": f"{type(e).__name__}: {e}", "wall_s": round(time.time() - started, 1)})
        (out / "ledger.json").write_text(json.dumps({**row, "faults_injected": ctx.faults}, indent=1))
    finally:
        ctx.close()
    return row


def committed_offsets(bootstrap: str, group: str, topic: str) -> dict[str, int | None]:
    """Consumer group `group`'s committed offsets on `topic` (None: nothing committed on that partition)."""
    source = connect(KafkaConfig(), bootstrap).source(group=group, topics=[])
    try:
        return dict(source.committed(topic))
    finally:
        source.close()


def tasks_committed(bootstrap: str, name: str) -> dict[str, int]:
    """The explorers' committed offsets on the tasks topic (the newest group if the fleet moved)."""
    transport = connect(KafkaConfig(), bootstrap)
    best: dict[str, int] = {}
    for group in (f"{name}.explorers", *(f"{name}.explorers.{i}" for i in range(1, 4))):
        source = transport.source(group=group, topics=[])
        try:
            for key, offset in source.committed(f"{name}.tasks").items():
                if offset is not None:
                    best[key] = max(best.get(key, 0), offset)
        finally:
            source.close()
    return best


COLUMNS = (("scenario", 16), ("faults", 6), ("acked", 6), ("trained", 7), ("pending", 7), ("lost", 4),
           ("dup", 3), ("dup rec", 7), ("dead let", 8), ("stale", 5), ("stall s", 12), ("stale max", 9),
           ("wall s", 6), ("result", 6))


def table(rows: list[dict]) -> str:
    lines = [" ".join(f"{name:>{w}}" if i else f"{name:<{w}}" for i, (name, w) in enumerate(COLUMNS))]
    for r in rows:
        if "error" in r:
            lines.append(f"{r['scenario']:<16} ERROR {r['error']}")
            continue
        cells = [r["scenario"], r["faults"], r["acknowledged"], r["trained"], r["pending"], r["lost"],
                 r["duplicated"], r["dup_records"], f"{r['dead_letters']}", r["skipped"].get("stale", 0),
                 f"{r['longest_stall_s']}/{r['stall_bound_s']:.0f}", f"{r['staleness_max']}/{r['staleness_bound']}",
                 r["wall_s"], "pass" if r["passed"] else "FAIL"]
        lines.append(" ".join(f"{c!s:>{w}}" if i else f"{c!s:<{w}}"
                              for i, (c, (_, w)) in enumerate(zip(cells, COLUMNS, strict=True))))
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="rft chaos", description=__doc__.split("\n")[0])
    parser.add_argument("--scenario", action="append", metavar="NAME[+NAME]",
                        help=f"repeatable; one of {', '.join(SCENARIOS)}, or A+B: their faults in one run")
    parser.add_argument("--all", action="store_true", help="every scenario")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="where each scenario's files go (default: a temporary directory)")
    parser.add_argument("--quick", action="store_true", help="fewer faults and steps (the CI subset)")
    args = parser.parse_args(argv)
    if not args.all and not args.scenario:
        parser.error("name one or more --scenario, or --all")
    names = list(SCENARIOS) if args.all else args.scenario
    try:
        scenarios = [combined(name) for name in names]
    except ValueError as e:
        parser.error(str(e))
    out = Path(args.out or tempfile.mkdtemp(prefix="rft-chaos-"))
    out.mkdir(parents=True, exist_ok=True)
    from rft.models.tiny import make_tiny_model  # heavy: transformers
    model = out / "tiny-model"
    if not (model / "config.json").exists():
        make_tiny_model(model)
    started, rows = time.time(), []
    for scenario in scenarios:
        print(f"[chaos] scenario {scenario.name} (seed {args.seed})", flush=True)
        rows.append(run_scenario(scenario, out / scenario.run, model, args.seed, args.quick))
        print(table(rows[-1:]), flush=True)
    wall = round(time.time() - started, 1)
    (out / "chaos.json").write_text(json.dumps({"seed": args.seed, "quick": args.quick, "wall_s": wall,
                                                "scenarios": rows}, indent=1))
    print(f"\nrft chaos, seed {args.seed}{' (quick)' if args.quick else ''}: {len(rows)} scenarios in {wall:.0f} s "
          f"({out})\n{table(rows)}", flush=True)
    return 0 if all(r["passed"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
