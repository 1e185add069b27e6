"""`rft status CONFIG`: a live run as its control topic tells it: the trainer's step and version, the explorer fleet
(who joined, who is live, left or silent, which weights each holds, what each produced), the consumer lags of the
experiences and tasks topics, and throughput over the last minute. Read-only: it joins no consumer group.

For a run started by `rft run` with `kafka.bootstrap_servers: embedded`, pass the run's resolved config
(`runs/<name>/config.yaml`), which names the broker that run started.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict

from rft.commandline import add_config_arguments, config_from_args
from rft.config import Config
from rft.control import ControlView, ExplorerView, TrainerView, control_messages
from rft.run_topics import consumer_group
from rft.schema import ControlMessage
from rft.transport import Admin, RecordSource, TransportError, connect, lag

WINDOW_S = 60.0  # throughput window


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
            raise StatusError(f"no run {cfg.run.name!r} on {cfg.kafka.bootstrap_servers}: topic "
                              f"{cfg.topic('control')} does not exist (topics there: {', '.join(sorted(topics))[:300]})")
        status = RunStatus(cfg.explorer.heartbeat_s)
        messages = control_messages(source.read_range(cfg.topic("control"), idle_timeout_s=5.0))
        for message in sorted(messages, key=lambda c: c.created_at):
            status.apply(message)  # in time order: partitions interleave (a leave may be read before its join)
        now = time.time()
        status.finish(now)
        lags = topic_lags(cfg, source, admin, status.trainer.offsets)
    finally:
        source.close()
        admin.close()
    t = status.trainer
    return {
        "run": cfg.run.name, "mode": cfg.run.mode, "max_staleness": cfg.run.max_staleness,
        "bootstrap": cfg.kafka.bootstrap_servers, "max_steps": cfg.run.max_steps, "time": now,
        "trainer": {**{k: v for k, v in asdict(t).items() if k != "history"},
                    "seconds_since_seen": now - t.last_seen if t.last_seen else None},
        "weights": {"method": cfg.sync.method, "path": status.weights_path, "push_group": status.push_group,
                    "push_abandoned": status.push_abandoned},
        "explorers": explorer_rows(status, now),
        **lags,
        "throughput": {"groups_per_s": status.groups_per_s(now), "steps_per_s": status.steps_per_s(now),
                       "window_s": WINDOW_S},
    }


def explorer_rows(status: RunStatus, now: float) -> list[dict]:
    """The fleet as JSON-able rows, by explorer id: every ExplorerView field but its history, the state at `now`
    (RunStatus.state_of) and `seconds_since_seen`."""
    return [{**{k: v for k, v in asdict(e).items() if k != "history"}, "state": status.state_of(e, now),
             "seconds_since_seen": now - e.last_seen}
            for e in sorted(status.explorers.values(), key=lambda e: e.explorer_id)]


def topic_lags(cfg: Config, source: RecordSource, admin: Admin, consumed: dict[str, int]) -> dict:
    """`{"experiences": {"produced", "lag"}, "tasks": {"published", "lag"}}`: records in the run's experiences
    topic and those after the trainer's `consumed` offsets; tasks published and those the explorers' consumer
    group has not committed yet. TransportError when the broker does not answer."""
    experiences_end = source.end_offsets(cfg.topic("experiences"))
    tasks_end = source.end_offsets(cfg.topic("tasks"))
    try:
        tasks_done = admin.group_offsets(consumer_group(cfg))
    except TransportError:
        tasks_done = {}
    return {"experiences": {"produced": sum(experiences_end.values()), "lag": lag(experiences_end, consumed)},
            "tasks": {"published": sum(tasks_end.values()), "lag": lag(tasks_end, tasks_done)}}


class StatusError(RuntimeError):
    pass


def render(report: dict) -> str:
    t, x = report["trainer"], report["explorers"]
    bound = f", k={report['max_staleness']}" if report["mode"] == "off_policy" else ""
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
        f"explorers: {live} live, {len(x) - live} silent or left",
    ]
    if x:
        lines.append(f"  {'id':<24} {'state':<7} {'host':<16} {'weights':>7} {'groups':>7} {'batches':>7} "
                     f"{'waits':>6} {'busy':>5} {'seen':>7}")
        for e in x:
            busy = "-" if e["busy"] is None else f"{e['busy']:.0%}"
            state = e["state"] + (f" ({e['left_reason']})" if e["left_reason"] else "")
            lines.append(f"  {e['explorer_id']:<24} {state:<7} {e['host'][:16]:<16} {'v' + str(e['weights_version']):>7} "
                         f"{e['groups']:>7} {e['batches']:>7} {e['admission_waits']:>6} {busy:>5} "
                         f"{e['seconds_since_seen']:>5.0f} s")
    return "\n".join(lines)


def main(argv: list[str]) -> int:

    parser = argparse.ArgumentParser(prog="rft status", description=__doc__.split("\n")[0])
    add_config_arguments(parser)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--watch", type=float, default=0, metavar="SECONDS", help="refresh every SECONDS until Ctrl-C")
    args = parser.parse_args(argv)
    cfg = config_from_args(args)
    if cfg.kafka.bootstrap_servers == "embedded":
        resolved = cfg.run_dir / "config.yaml"
        hint = f" (pass {resolved}, which names the broker `rft run` started)" if resolved.exists() else ""
        print(f"rft status: kafka.bootstrap_servers is 'embedded': there is no broker address to read{hint}",
              file=sys.stderr)
        return 2
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
