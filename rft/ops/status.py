"""`rft status CONFIG`: a live run as its control topic tells it: the trainer's step and version, the explorer fleet
(who joined, who is live, left or silent, which weights each holds, what each produced, which tasks partitions each
holds), the consumer lags of the experiences and tasks topics, throughput over the last minute, and the newest
step's training-inference mismatch and where its time went (its `trainer_step` message: `mismatch_line`,
`signal_line`). Read-only: it joins no consumer group.

Fleet health (`fleet_health`, in `--json` as "fleet"): the live explorers holding no tasks partition ("explorers
idle: 2 of 6 (4 task partitions)": normal when the fleet outgrows the partitions) and a stall, said loudly:
  - "STALLED: 1752 tasks pending, no explorer holds a partition for 45 s": tasks wait and no live explorer's newest
    heartbeat names a partition, for longer than STALL_AFTER_S (the consumer group gave nobody work; the explorers'
    watchdog rejoins, see rft/explorer/membership.py);
  - "STALLED: 1752 tasks pending, the trainer waits and the explorers produced nothing for 75 s": tasks wait, the
    trainer waits for experiences, and no live explorer's group count grew for longer than the throughput window.
`rft run` checks the same every `STALL_CHECK_S` and prints it (`StallWatch`).

For a run started by `rft run` with `kafka.bootstrap_servers: embedded`, pass the run's resolved config
(`runs/<name>/config.yaml`), which names the broker that run started.
"""
from __future__ import annotations

import argparse
import itertools
import json
import logging
import sys
import threading
import time
from dataclasses import asdict
from pathlib import Path

from rft.cli.commandline import add_config_arguments, config_from_args
from rft.explorer.membership import group_name
from rft.modes import mode
from rft.run.config import Config
from rft.schema import FAILURE_CLASSES, ControlMessage
from rft.transport import Admin, RecordSource, TransportError, connect, lag
from rft.transport.control import ControlView, ExplorerView, TrainerView, control_messages
from rft.transport.run_topics import consumer_group

log = logging.getLogger(__name__)

WINDOW_S = 60.0  # throughput window
STALL_CHECK_S = 30.0  # how often `rft run` looks for a stall
STARVED_KEEP = 0.15  # a trainer keeping fewer of its fresh groups, and waiting most of its step, is starved
STALL_AFTER_S = 20.0  # no partition held for longer than this is a stall (a group's first rebalance takes seconds)


class RunStatus:
    """The run as its control messages, applied in time order, tell it (a ControlView), and what the status
    derives from it: silent explorers and throughput."""

    def __init__(self, heartbeat_s: float):
        self.heartbeat_s = heartbeat_s
        self.view = ControlView()

    @property
    def trainer(self) -> TrainerView:
        return self.view.trainer

    @property
    def explorers(self) -> dict[str, ExplorerView]:
        return self.view.explorers

    @property
    def weights_path(self) -> str:
        return self.view.weights_path

    @property
    def push_group(self) -> str | None:
        return None if self.view.push_group is None else self.view.push_group.group_id

    @property
    def push_abandoned(self) -> bool:
        return self.view.push_abandoned

    def apply(self, message: ControlMessage) -> None:
        self.view.apply(message)

    def state_of(self, explorer: ExplorerView, now: float) -> str:
        """The explorer's state at `now`: `silent` (dead or stuck) when live but without a message for three
        heartbeat intervals, else its state as its messages tell it (live | left)."""
        if explorer.state == "live" and now - explorer.last_seen > 3 * self.heartbeat_s:
            return "silent"
        return explorer.state

    def finish(self, now: float) -> None:
        """Mark explorers without a message for three heartbeat intervals as silent (see `state_of`)."""
        for e in self.explorers.values():
            e.state = self.state_of(e, now)

    def groups_per_s(self, now: float) -> float:
        total = 0.0
        for e in self.explorers.values():
            recent = [(t, g) for t, g in e.history if now - t <= WINDOW_S]
            if len(recent) >= 2 and recent[-1][0] > recent[0][0]:
                total += (recent[-1][1] - recent[0][1]) / (recent[-1][0] - recent[0][0])
        return total

    def quiet_s(self, now: float) -> float | None:
        """Seconds since a live explorer's group count last grew (since the first heartbeat of the live fleet when
        none grew); None without heartbeats."""
        latest = None
        for e in self.explorers.values():
            if e.state != "live" or not e.history:
                continue
            moved = e.history[0][0]
            for (_, before), (t, after) in itertools.pairwise(e.history):
                if after > before:
                    moved = t
            latest = moved if latest is None else max(latest, moved)
        return None if latest is None else now - latest

    def steps_per_s(self, now: float) -> float:
        recent = [(t, v) for t, v in self.trainer.history if now - t <= WINDOW_S]
        if len(recent) < 2 or recent[-1][0] <= recent[0][0]:
            return 0.0
        return (recent[-1][1] - recent[0][1]) / (recent[-1][0] - recent[0][0])


def collect(cfg: Config) -> dict:
    """The run's status as one JSON-able dict (what `--json` prints)."""
    transport = connect(cfg.kafka)
    source = transport.source(client_id=f"{cfg.run.name}-status")
    admin = transport.admin()
    try:
        topics = set(admin.list_topics())
        if cfg.topic("control") not in topics:
            there = ", ".join(sorted(topics))[:300]
            raise StatusError(f"no run {cfg.run.name!r} on {cfg.kafka.bootstrap_servers}: topic "
                              f"{cfg.topic('control')} does not exist (topics there: {there})")
        status = RunStatus(cfg.explorer.heartbeat_s)
        messages = control_messages(source.read_range(cfg.topic("control"), idle_timeout_s=5.0))
        for message in sorted(messages, key=lambda c: c.created_at):
            status.apply(message)  # in time order: partitions interleave (a leave may be read before its join)
        now = time.time()
        status.finish(now)
        lags = topic_lags(cfg, source, admin, status.trainer.offsets, tasks_group_of(cfg, status))
    finally:
        source.close()
        admin.close()
    t = status.trainer
    return {
        "run": cfg.run.name, "mode": cfg.run.mode, "max_staleness": cfg.run.max_staleness,
        "async_max_staleness": cfg.run.async_max_staleness,
        "mismatch_ratio": cfg.trainer.mismatch_ratio,
        "bootstrap": cfg.kafka.bootstrap_servers, "max_steps": cfg.run.max_steps, "time": now,
        "trainer": {**{k: v for k, v in asdict(t).items() if k != "history"},
                    "seconds_since_seen": now - t.last_seen if t.last_seen else None},
        "weights": {"method": cfg.sync.method, "path": status.weights_path, "push_group": status.push_group,
                    "push_abandoned": status.push_abandoned},
        "explorers": explorer_rows(status, now),
        **lags,
        "throughput": {"groups_per_s": status.groups_per_s(now), "steps_per_s": status.steps_per_s(now),
                       "window_s": WINDOW_S},
        "fleet": fleet_health(status, now=now, task_partitions=lags["tasks"]["partitions"],
                              pending=lags["tasks"]["lag"]),
    }


def explorer_rows(status: RunStatus, now: float) -> list[dict]:
    """The fleet as JSON-able rows, by explorer id: every ExplorerView field but its history, the state at `now`
    (RunStatus.state_of) and `seconds_since_seen`."""
    return [{**{k: v for k, v in asdict(e).items() if k != "history"}, "state": status.state_of(e, now),
             "seconds_since_seen": now - e.last_seen}
            for e in sorted(status.explorers.values(), key=lambda e: e.explorer_id)]


def tasks_group_of(cfg: Config, status: RunStatus) -> str:
    """The explorers' current tasks consumer group: `<run>.explorers`, or the fresh group their membership watchdog
    moved them to (the newest `tasks_group` control message)."""
    moved = status.view.tasks_group
    return group_name(consumer_group(cfg), moved.epoch if moved is not None else 0)


def topic_lags(cfg: Config, source: RecordSource, admin: Admin, consumed: dict[str, int],
               tasks_group: str | None = None) -> dict:
    """`{"experiences": {"produced", "lag"}, "tasks": {"published", "lag", "group", "partitions"}}`: records in the
    run's experiences topic and those after the trainer's `consumed` offsets; tasks published and those the
    explorers' consumer group (`tasks_group`, default `<run>.explorers`) has not committed yet, and the tasks
    topic's partition count. TransportError when the broker does not answer."""
    tasks_group = tasks_group or consumer_group(cfg)
    experiences_end = source.end_offsets(cfg.topic("experiences"))
    tasks_end = source.end_offsets(cfg.topic("tasks"))
    try:
        tasks_done = admin.group_offsets(tasks_group)
    except TransportError:
        tasks_done = {}
    return {"experiences": {"produced": sum(experiences_end.values()), "lag": lag(experiences_end, consumed)},
            "tasks": {"published": sum(tasks_end.values()), "lag": lag(tasks_end, tasks_done), "group": tasks_group,
                      "partitions": len(tasks_end)}}


def fleet_health(status: RunStatus, *, now: float, task_partitions: int, pending: int) -> dict:
    """The fleet's hold on the tasks topic and a stall, if any (module docstring): `live`, `idle` (live explorers
    holding no partition), `task_partitions`, `unassigned_s` (how long no live explorer has held a partition,
    None while one does), `quiet_s` (see RunStatus.quiet_s), `stalled` (the loud line, or None)."""
    live = [e for e in status.explorers.values() if e.state == "live"]
    idle = [e for e in live if not e.partitions]
    unassigned_s = min((e.unassigned_s + now - e.last_seen for e in live), default=None) \
        if live and len(idle) == len(live) else None
    quiet_s = status.quiet_s(now)
    stalled = None
    if pending > 0 and unassigned_s is not None and unassigned_s > STALL_AFTER_S:
        stalled = f"STALLED: {pending} tasks pending, no explorer holds a partition for {unassigned_s:.0f} s"
    elif pending > 0 and status.trainer.state == "waiting" and quiet_s is not None and quiet_s > WINDOW_S:
        stalled = (f"STALLED: {pending} tasks pending, the trainer waits and the explorers produced nothing for "
                   f"{quiet_s:.0f} s")
    return {"live": len(live), "idle": len(idle), "task_partitions": task_partitions,
            "unassigned_s": unassigned_s, "quiet_s": quiet_s, "stalled": stalled,
            "rejoins": sum(e.rejoins for e in status.explorers.values())}


def fleet_line(fleet: dict) -> str:
    """`explorers idle: 2 of 6 (4 task partitions)`, with the watchdog's rejoins when there were any."""
    rejoins = f"; membership watchdog rejoins: {fleet['rejoins']}" if fleet["rejoins"] else ""
    return f"explorers idle: {fleet['idle']} of {fleet['live']} ({fleet['task_partitions']} task partitions){rejoins}"


class StatusError(RuntimeError):
    pass


class StallWatch:
    """`rft run`'s stall check, called on every supervision tick: when the trainer's metrics (`metrics_path`) have
    not grown for `every_s`, reads the status (`collect`, in a background thread, at most every `every_s`) and
    prints the STALLED line while there is one, `recovered` once it is gone, and the idle line when it changes.
    Every reading's "fleet" (with tasks pending and the time) is appended to `<run dir>/health.jsonl`."""

    def __init__(self, cfg: Config, metrics_path: Path, *, every_s: float = STALL_CHECK_S, say=print):
        self.cfg, self.metrics_path, self.every_s, self.say = cfg, metrics_path, every_s, say
        self.health_path = cfg.run_dir / "health.jsonl"
        self._next = time.monotonic() + every_s
        self._thread: threading.Thread | None = None
        self._stalled: str | None = None
        self._idle_line = ""

    def __call__(self) -> None:
        now = time.monotonic()
        if now < self._next or (self._thread is not None and self._thread.is_alive()):
            return
        self._next = now + self.every_s
        try:
            if time.time() - self.metrics_path.stat().st_mtime < self.every_s:
                return  # the trainer is stepping
        except FileNotFoundError:
            pass
        self._thread = threading.Thread(target=self.check, name="stall-watch", daemon=True)
        self._thread.start()

    def check(self) -> dict | None:
        """One reading: print what changed, append to health.jsonl; returns the report's "fleet" (None: unreadable)."""
        try:
            report = collect(self.cfg)
        except (StatusError, TransportError) as e:
            log.warning("stall check: cannot read the run's status: %s", e)
            return None
        fleet = report["fleet"]
        with open(self.health_path, "a") as f:
            f.write(json.dumps({"time": report["time"], "tasks_pending": report["tasks"]["lag"],
                                "groups_per_s": report["throughput"]["groups_per_s"], **fleet}) + "\n")
        if fleet["stalled"]:
            self.say(f"[rft] {fleet['stalled']} (rft status {self.cfg.run_dir / 'config.yaml'})", flush=True)
        elif self._stalled:
            self.say(f"[rft] recovered: {report['tasks']['lag']} tasks pending, "
                     f"{report['throughput']['groups_per_s']:.2f} groups/s", flush=True)
        self._stalled = fleet["stalled"]
        idle_line = fleet_line(fleet)
        if fleet["idle"] and not fleet["stalled"] and idle_line != self._idle_line:
            self.say(f"[rft] {idle_line}", flush=True)
        self._idle_line = idle_line
        return fleet


def render(report: dict) -> str:
    t, x = report["trainer"], report["explorers"]
    bound = f", k={report['max_staleness']}" if mode(report["mode"]).bound == "max_staleness" else ""
    if mode(report["mode"]).soft_bound:
        lead = report.get("async_max_staleness")
        bound = ", explorers never wait" if lead is None else f", explorers wait at staleness {lead}"
    seen = f", last message {t['seconds_since_seen']:.0f} s ago" if t["seconds_since_seen"] is not None else ""
    live = sum(e["state"] == "live" for e in x)
    lines = [
        f"run {report['run']} (mode {report['mode']}{bound}) on {report['bootstrap']}",
        f"trainer: {t['state']}, step {t['step']}/{report['max_steps']}, weights version {t['version']}{seen}",
        f"weights: {report['weights']['method']}" + (" (push abandoned: pulling)" if report["weights"]["push_abandoned"]
                                                      else ""),
        f"experiences: {report['experiences']['produced']} records, {report['experiences']['lag']} not consumed yet; "
        f"tasks: {report['tasks']['published']} published, {report['tasks']['lag']} not taken yet",
        f"throughput (last {report['throughput']['window_s']:.0f} s): {report['throughput']['groups_per_s']:.2f} "
        f"groups/s from explorers, {report['throughput']['steps_per_s']:.2f} trainer steps/s",
        f"explorers: {live} live, {len(x) - live} silent or left; {fleet_line(report['fleet'])}",
    ]
    if t.get("metrics"):
        lines.append(mismatch_line(t["step"], t["metrics"], report.get("mismatch_ratio", 2.0)))
        signal = signal_line(t["step"], t["metrics"])
        if signal:
            lines.append(signal)
    failures = failures_line(t.get("metrics") or {}, x)
    if failures:
        lines.append(failures)
    refused = sum(e.get("weights_refused", 0) for e in x)
    if refused:
        lines.append(f"REFUSED: {refused} weights announcements did not pass the explorers' trust checks (a path "
                     "outside the weight store, a version that does not match its manifest, or a push group from a "
                     "host not allowed): see the explorers' logs and docs/operations.md, Trust")
    if report["fleet"]["stalled"]:
        lines.insert(0, report["fleet"]["stalled"])
    if x:
        lines.append(f"  {'id':<24} {'state':<7} {'host':<16} {'weights':>7} {'groups':>7} {'batches':>7} "
                     f"{'waits':>6} {'refused':>7} {'busy':>5} {'seen':>7}  partitions")
        for e in x:
            busy = "-" if e["busy"] is None else f"{e['busy']:.0%}"
            state = e["state"] + (f" ({e['left_reason']})" if e["left_reason"] else "")
            version = "v" + str(e["weights_version"])
            lines.append(f"  {e['explorer_id']:<24} {state:<7} {e['host'][:16]:<16} {version:>7} {e['groups']:>7} "
                         f"{e['batches']:>7} {e['admission_waits']:>6} {e.get('weights_refused', 0):>7} {busy:>5} "
                         f"{e['seconds_since_seen']:>5.0f} s  {','.join(map(str, e['partitions'])) or '-'}")
    return "\n".join(lines)


def mismatch_line(step: int, metrics: dict[str, float], ratio: float) -> str:
    """The training-inference mismatch of the trainer's newest step (its `trainer_step` message; the metrics:
    rft/algorithms/mismatch.py): `mismatch (step 12): |dlogp| mean 0.0123 max 0.51, KL 0.00041, 0.2% of tokens past
    ratio 2; by staleness: 0: 0.0101, 1: 0.0164`."""
    m = lambda key: metrics.get(f"logprob_mismatch_{key}")  # noqa: E731
    if m("mean") is None:
        return f"mismatch (step {step}): not reported"
    line = (f"mismatch (step {step}): |dlogp| mean {m('mean'):.4f} max {m('max'):.3f}, KL {m('kl') or 0.0:.5f}, "
            f"{100 * (m('frac') or 0.0):.1f}% of tokens past ratio {ratio:g}")
    prefix, suffix = "logprob_mismatch_stale", "_mean"  # logprob_mismatch_stale1_mean, ..._stale4plus_mean
    stale = {k[len(prefix):-len(suffix)]: v for k, v in metrics.items() if k.startswith(prefix) and k.endswith(suffix)}
    if stale:
        ordered = sorted(stale.items(), key=lambda kv: int(kv[0].removesuffix("plus")))
        line += "; by staleness: " + ", ".join(f"{name.replace('plus', '+')}: {v:.4f}" for name, v in ordered)
    return line


def failures_line(metrics: dict[str, float], explorers: list[dict]) -> str | None:
    """Rollouts that failed outside the policy (Sample.failure), per failure class: marked by the explorers (their
    heartbeats' `failed`, summed) and met by the trainer (its newest step's `failed_<class>_total`), with the groups
    the trainer dropped for too few scored samples: `failed rollouts: explorers timeout 3, verifier 1; trainer
    timeout 3, verifier 1, 1 group dropped (too few scored)`. None when there were none."""
    marked: dict[str, int] = {}
    for e in explorers:
        for name, n in (e.get("failed") or {}).items():
            marked[name] = marked.get(name, 0) + int(n)
    met = {c: int(metrics.get(f"failed_{c}_total", 0)) for c in FAILURE_CLASSES}
    dropped = int(metrics.get("failed_groups_dropped_total", 0))
    parts = []
    if any(marked.values()):
        parts.append("explorers " + ", ".join(f"{c} {n}" for c, n in sorted(marked.items()) if n))
    if any(met.values()) or dropped:
        trainer = [f"{c} {n}" for c, n in met.items() if n] + ([f"{dropped} groups dropped (too few scored)"]
                                                                if dropped else [])
        parts.append("trainer " + ", ".join(trainer))
    return "failed rollouts: " + "; ".join(parts) if parts else None


def signal_line(step: int, metrics: dict[str, float]) -> str | None:
    """Where the trainer's newest step went (its `trainer_step` message): `learning signal (step 41): 8% of fresh
    groups kept, waited 15.6 s of a 21.5-s step for experiences, entropy 0.13`, and, when the filter keeps under
    STARVED_KEEP of the groups and the trainer waited most of its step, why: the policy's samples of a task agree
    (docs/benchmarks.md, "where the time went"). None when the step reported none of these."""
    keep, wait, step_s, entropy = (metrics.get(k) for k in ("keep_fraction", "data_wait_s", "step_time_s", "entropy"))
    parts = []
    if keep is not None:
        parts.append(f"{keep:.0%} of fresh groups kept")
    if wait is not None and step_s:
        parts.append(f"waited {wait:.1f} s of a {step_s:.1f}-s step for experiences")
    if entropy is not None:
        parts.append(f"entropy {entropy:.2f}")
    if not parts:
        return None
    line = f"learning signal (step {step}): " + ", ".join(parts)
    if keep is not None and keep < STARVED_KEEP and wait is not None and step_s and wait > step_s / 2:
        line += ("; STARVED of informative groups: most groups' samples scored alike (a sharpened policy), so the "
                 "explorers generate many groups per one kept (docs/benchmarks.md, \"where the time went\")")
    return line


def main(argv: list[str]) -> int:

    parser = argparse.ArgumentParser(prog="rft status", description=__doc__.split("\n")[0])
    add_config_arguments(parser)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--watch", type=float, default=0, metavar="SECONDS", help="refresh every SECONDS until Ctrl-C")
    args = parser.parse_args(argv)
    cfg = config_from_args(args, joins_broker="rft status")
    while True:
        try:
            report = collect(cfg)
        except StatusError as e:
            print(f"rft status: {e}", file=sys.stderr)
            return 1
        print(json.dumps(report) if args.json else render(report), flush=True)
        if not args.watch:
            return 0
        try:
            time.sleep(args.watch)
        except KeyboardInterrupt:
            return 0
        if not args.json:
            print()
