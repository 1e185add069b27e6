"""`rft bench membership`: how long a consumer group stops consuming when one member joins, leaves or restarts,
with and without static membership (`group_instance_id`, KIP-345), against a real broker.

Starts a local broker (`rft.broker.local.LocalBroker`; `--bootstrap` uses another), creates a topic of `--partitions`
partitions and produces a steady stream into it (`--rate` records/s, round-robin over the partitions). Three
consumers A, B, C (real processes: `python -m benchmarks.membership consume ...`, each an `rft.transport`
source in one consumer group, committing after every poll) consume it. Then, one after the other:

  join      a fourth consumer D starts;
  leave     D is stopped with SIGTERM (a clean close: a dynamic member sends LeaveGroup, a static one does not);
  restart   C is stopped with SIGTERM and started again at once with the same id;
  crash     C is SIGKILLed and started again at once with the same id.

For each event the pause is the longest time, in the `--window` seconds after it, in which the members other
than the one that changed (A and B, with C for join and leave) consumed nothing at all, minus the normal gap
between two records of the stream (1 / rate), floored at 0; "own" is the longest pause of the restarted member
itself (from its stop to its first record after starting again), and "covered" the time after the event from which
the members present together held every partition to the end of the window (none: some partition was left without
a consumer, e.g. a static member's after it stopped, until the broker expired it). A consumer prints one JSON line
per poll that returned records and at least one a second (`{"t": time, "n": records, "partitions": [held]}`); the
orchestrator reads them.

Everything runs twice: dynamic members (instance id None) and static members (instance id = consumer name).
Prints one JSON object per mode and a table; the numbers in docs/operations.md come from this.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

from rft.broker.local import LocalBroker
from rft.transport import connect, parse_offset_key
from rft.transport.config import KafkaConfig

EVENTS = ("join", "leave", "restart", "crash")


# --------------------------------------------------------------------------------------------------
# One consumer process


def consume(args: argparse.Namespace) -> int:
    """Consume `args.topic` in `args.group` until SIGTERM (then close: commit nothing more, leave as the
    membership kind does); one JSON line per poll with records, and one a second without."""
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {args.name} %(name)s %(levelname)s %(message)s")
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    cfg = KafkaConfig(session_timeout_ms=args.session_timeout_ms, max_poll_interval_ms=args.session_timeout_ms)
    source = connect(cfg, args.bootstrap).source(group=args.group, topics=[args.topic], client_id=args.name,
                                                 group_instance_id=args.instance_id or None)
    said = 0.0
    try:
        while not stop.is_set():
            messages = source.poll(timeout_s=0.2)
            if messages:
                source.commit()
            if messages or time.monotonic() - said > 1.0:
                said = time.monotonic()
                print(json.dumps({"t": time.time(), "n": len(messages),
                                  "partitions": sorted(parse_offset_key(k).partition for k in source.assignment())}),
                      flush=True)
    finally:
        source.close()
    return 0


# --------------------------------------------------------------------------------------------------
# The orchestrator


class Member:
    """A consumer process and the times at which it consumed (read from its stdout by a thread)."""

    def __init__(self, name: str, *, bootstrap: str, topic: str, group: str, static: bool, session_timeout_ms: int,
                 log_dir: Path):
        self.name, self.times = name, []
        self.held: list[tuple[float, list[int]]] = []  # (time, partitions held) from every line
        command = [sys.executable, "-m", "benchmarks.membership", "consume", "--bootstrap", bootstrap,
                   "--topic", topic, "--group", group, "--name", name,
                   "--session-timeout-ms", str(session_timeout_ms)]
        if static:
            command += ["--instance-id", name]
        self.process = subprocess.Popen(command, stdout=subprocess.PIPE, text=True,
                                        stderr=open(log_dir / f"{name}.log", "a"),
                                        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.process.stdout:
            try:
                said = json.loads(line)
                self.held.append((said["t"], said["partitions"]))
                if said["n"]:
                    self.times.append(said["t"])
            except (ValueError, KeyError):
                pass

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.process.poll() is None:
            self.process.send_signal(sig)
        self.process.wait(timeout=60)


def longest_gap(times: list[float], start: float, end: float) -> float:
    """The longest interval in [start, end] without any of `times`."""
    points = [start] + sorted(t for t in times if start < t < end) + [end]
    return max(b - a for a, b in zip(points, points[1:], strict=False))


def held_at(member: Member, t: float) -> set[int]:
    """The partitions `member` said it held at time `t` (its newest line before `t`)."""
    held = [p for when, p in member.held if when <= t]
    return set(held[-1]) if held else set()


def covered_after(members: list[Member], at: float, end: float, partitions: int) -> float | None:
    """Seconds after `at` from which `members` together held every partition until `end` (None: not by `end`)."""
    since, t = None, at
    while t <= end:
        full = set().union(*(held_at(m, t) for m in members)) >= set(range(partitions))
        since = (since if since is not None else t) if full else None
        t += 0.25
    return None if since is None else round(since - at, 2)


def wait_consuming(members: list[Member], timeout_s: float = 60.0) -> None:
    """Until every member consumed within the last second."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        now = time.time()
        if all(m.times and now - m.times[-1] < 1.0 for m in members):
            return
        time.sleep(0.2)
    raise RuntimeError(f"members {[m.name for m in members if not m.times or time.time() - m.times[-1] >= 1]} "
                       f"did not start consuming within {timeout_s:.0f} s")


def run_mode(bootstrap: str, *, static: bool, partitions: int, rate: float, window_s: float,
             session_timeout_ms: int, log_dir: Path) -> dict:
    cfg = KafkaConfig(partitions=partitions)
    transport = connect(cfg, bootstrap)
    topic, group = f"bench-membership-{uuid.uuid4().hex[:6]}", f"bench-{uuid.uuid4().hex[:6]}"
    admin = transport.admin()
    admin.create_topics([topic])
    admin.close()
    sink = transport.sink(client_id="bench-producer", linger_ms=0)
    producing = threading.Event()
    producing.set()

    def produce() -> None:
        i = 0
        while producing.is_set():
            sink.send(topic, b"x" * 100, partition=i % partitions)
            i += 1
            time.sleep(1 / rate)

    threading.Thread(target=produce, daemon=True).start()
    kwargs = dict(bootstrap=bootstrap, topic=topic, group=group, static=static,
                  session_timeout_ms=session_timeout_ms, log_dir=log_dir)
    members = {n: Member(n, **kwargs) for n in ("A", "B", "C")}
    results: dict = {"static": static, **{k: None for e in EVENTS for k in (e, f"{e}_covered")},
                     "restart_own": None, "crash_own": None}
    try:
        wait_consuming(list(members.values()))
        time.sleep(window_s)  # let the group settle after the initial joins

        def pause(at: float, names: tuple[str, ...], event: str, present: tuple[str, ...]) -> float:
            time.sleep(window_s)
            times = sorted(t for n in names for t in members[n].times)
            results[f"{event}_covered"] = covered_after([members[n] for n in present], at, at + window_s, partitions)
            return round(max(0.0, longest_gap(times, at, at + window_s) - 1 / rate), 2)

        at = time.time()
        members["D"] = Member("D", **kwargs)
        results["join"] = pause(at, ("A", "B", "C"), "join", ("A", "B", "C", "D"))
        at = time.time()
        members["D"].stop()
        results["leave"] = pause(at, ("A", "B", "C"), "leave", ("A", "B", "C"))
        for event, sig in (("restart", signal.SIGTERM), ("crash", signal.SIGKILL)):
            wait_consuming([members[n] for n in ("A", "B", "C")])
            at = time.time()
            members["C"].stop(sig)
            members["C"] = Member("C", **kwargs)
            results[event] = pause(at, ("A", "B"), event, ("A", "B", "C"))
            restarted = members["C"].times
            results[f"{event}_own"] = round(restarted[0] - at, 2) if restarted else None
    except RuntimeError as e:  # a member that never consumed again: the measurement of this mode ends here
        results["error"] = str(e)
    finally:
        producing.clear()
        for m in members.values():
            m.stop(signal.SIGKILL)
        sink.close()
    return results


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="rft bench membership", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command")
    c = sub.add_parser("consume", help="(internal) one consumer process")
    c.add_argument("--bootstrap", required=True)
    c.add_argument("--topic", required=True)
    c.add_argument("--group", required=True)
    c.add_argument("--name", required=True)
    c.add_argument("--instance-id", default="")
    c.add_argument("--session-timeout-ms", type=int, default=6000)
    parser.add_argument("--bootstrap", default=None, help="an existing broker (default: start a local one)")
    parser.add_argument("--partitions", type=int, default=6)
    parser.add_argument("--rate", type=float, default=100.0, help="records per second produced")
    parser.add_argument("--window", type=float, default=12.0, help="seconds observed after each event")
    parser.add_argument("--session-timeout-ms", type=int, default=6000)
    parser.add_argument("--modes", default="dynamic,static")
    parser.add_argument("--log-dir", default="bench-membership-logs")
    args = parser.parse_args(argv)
    if args.command == "consume":
        return consume(args)
    log_dir = Path(args.log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    broker = None
    if args.bootstrap is None:
        broker = LocalBroker(log_path=log_dir / "broker.log").start()
    bootstrap = args.bootstrap or broker.bootstrap_servers
    rows = []
    try:
        for mode in args.modes.split(","):
            row = run_mode(bootstrap, static=mode == "static", partitions=args.partitions, rate=args.rate,
                           window_s=args.window, session_timeout_ms=args.session_timeout_ms, log_dir=log_dir)
            print(json.dumps(row), flush=True)
            rows.append(row)
    finally:
        if broker is not None:
            broker.stop()
    print(f"\npause of the other members' consumption (s), session timeout {args.session_timeout_ms} ms, "
          f"{args.partitions} partitions, {args.rate:.0f} records/s:")
    print(f"{'membership':<10} " + " ".join(f"{e:>8}" for e in EVENTS) + f" {'own(restart)':>13} {'own(crash)':>11}"
          + " " + " ".join(f"{'covered(' + e + ')':>17}" for e in EVENTS))
    for row in rows:
        print(f"{'static' if row['static'] else 'dynamic':<10} " + " ".join(f"{row[e]!s:>8}" for e in EVENTS)
              + f" {row['restart_own']!s:>13} {row['crash_own']!s:>11} "
              + " ".join(f"{row[e + '_covered']!s:>17}" for e in EVENTS)
              + (f"  ({row['error']})" if row.get("error") else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
