"""Admission control at the explorers: how many rollouts may start now (`explorer.admission`).

`StalenessAdmission` (`explorer.admission: staleness`, the default) is AReaL's staleness manager, counted in
groups and shared by the fleet. With B = trainer.groups_per_step and k the run mode's staleness bound
(rft.modes), an explorer may start

    capacity = share((k + version + 1) * B - accepted_fleet) - (accepted_here + running)

groups now, where
  version         the weights version this explorer generates with (`set_version`);
  accepted_fleet  = trainer_version * B + backlog, the training slots taken as of the last reading of the fleet:
                  trainer_version is the trainer's newest version, backlog the experience groups produced but not
                  yet consumed by the trainer (the experiences topic's end offsets minus the trainer's consumed
                  offsets, as last announced);
  explorers       the live explorers sharing the capacity (>= 1);
  share(c)        this explorer's part of c: c // explorers, plus one more for the `c % explorers` lowest ranks
                  (rank: its place among the live explorers' ids, sorted; one not heard from yet comes last),
                  so the parts add up to c exactly and a fleet larger than c still starts c groups (a plain
                  c // explorers gives every member 0 once explorers > c: in sync mode a fleet larger than
                  groups_per_step would never start anything);
  accepted_here   groups this explorer finished (acknowledged by the broker) since that reading;
  running         groups it admitted and has not finished or given up.
With one explorer this is AReaL's (k + version + 1) * B - (accepted + running), accepted = accepted_fleet +
accepted_here; without a bound only `max_running` (if any) limits.

Why it bounds staleness: the trainer takes B groups per step in arrival order, so the j-th slot (1-based) is
trained in step ceil(j / B). A group admitted at version w holds one of the first (k + w + 1) * B slots, so if
groups finish in the order they were admitted it is trained in a step s <= k + w + 1, i.e. with staleness <= k.
A straggler overtaken by later rollouts can still exceed k; the trainer's StalenessTracker drops and counts it.
Each of n live explorers starts at most its share, and the shares add up to the capacity as of the reading. Groups
other explorers are running are not in a reading, so after a member's groups land the others' next shares can count
slots those running groups will take: a fleet of several explorers can start a few more groups than the bound per
version, which the trainer then drops as stale (counted; `rft bench modes` shows them as `dropped_stale`).

Where the reading comes from: a `FleetFeed`. In production `KafkaFleetFeed` replays the control topic into a
ControlView (the trainer announces its version and consumed offsets after every step and, while it waits for
data, every few seconds, so records it skipped never block admission; explorers are live when heard from within
three heartbeat intervals) and reads the experiences topic's end offsets, at most every `refresh_s`; an explorer
that admission refused waits on the control topic (`wait`) and reads again as soon as a message arrives. A reading
rebuilds the count (`resync`): after an explorer or trainer restart, or to correct drift. Rollouts that were
running in a dead explorer are gone (their tasks are re-explored), so `running` restarts at 0. Counting slots
rather than all groups ever accepted matters because groups the trainer drops never take a slot. A restarted
trainer announces its rewound offsets, the backlog grows by what it will consume again, and admission tightens by
itself. Unit tests drive the same object with an in-memory feed (tests/unit/test_staleness.py).
"""
from __future__ import annotations

import dataclasses
import logging
import sys
import threading
import time
from dataclasses import dataclass
from typing import Optional, Protocol

from rft.modes import staleness_bound
from rft.transport import RecordSource, Transport, TransportError, lag
from rft.transport.control import ControlView

log = logging.getLogger(__name__)


class Admission(Protocol):
    """How many rollouts may start now. Required: `admit(n) -> int`, 0 <= result <= n, called before each
    batch with the number of tasks at hand. Optional hooks, called when the object has them:
    `finish(k)` after k admitted groups were acknowledged by the broker, `fail(k)` for k admitted tasks
    given up (dead-lettered), `set_version(v)` after weights v were loaded (v never decreases),
    `wait(seconds)` after an admission let nothing start: block until something that may change the answer
    happens (for StalenessAdmission: a control message, e.g. the trainer's next version) or `seconds` pass."""

    def admit(self, n: int) -> int: ...


class AdmitAll:
    """`explorer.admission: all`: every task may start."""

    def admit(self, n: int) -> int:
        return n


# ------------------------------------------------------------------------------------------------ the formula

@dataclass(frozen=True)
class AdmissionState:
    version: int
    accepted: int  # accepted_fleet + accepted_here
    running: int


@dataclass(frozen=True)
class FleetReading:
    """What the fleet says now: the trainer's newest version, the groups produced and not consumed yet, and
    the live explorers sharing the capacity."""
    trainer_version: int
    backlog: int
    explorers: int = 1
    rank: int = 0  # this explorer's place among them (module docstring, `share`)


class FleetFeed(Protocol):
    """A source of readings: `read()` returns a new reading, or None when there is nothing new or it cannot
    be read now (the last reading stays in force: admission errs on the side of waiting). Optional:
    `wait(timeout_s) -> bool`, block until news arrives (True) or `timeout_s` passes (False)."""

    def read(self) -> FleetReading | None: ...
    def close(self) -> None: ...


class StalenessAdmission:
    """The formula of the module docstring. Thread-safe (one lock around the counters; the feed is read outside
    it). Use: `n = admit(wanted)` (alias `reserve`) before starting rollouts, then `finish(k)` for groups written
    to the experiences topic and `fail(k)` for groups given up; `set_version(v)` after loading weights v."""

    def __init__(self, *, groups_per_step: int, max_staleness: Optional[int], version: int = 0,
                 accepted: int = 0, max_running: Optional[int] = None, feed: FleetFeed | None = None,
                 refresh_s: float = 0.5):
        if groups_per_step < 1:
            raise ValueError(f"trainer.groups_per_step: must be >= 1, got {groups_per_step}")
        if max_running is not None and max_running < 1:
            raise ValueError(f"max_running: must be >= 1 or None, got {max_running}")
        self.groups_per_step, self.max_staleness, self.max_running = groups_per_step, max_staleness, max_running
        self.feed, self.refresh_s = feed, refresh_s
        self._state = AdmissionState(version=version, accepted=accepted, running=0)
        self._fleet_accepted, self._explorers, self._rank = accepted, 1, 0
        self._last_read = -float("inf")
        self._lock = threading.Lock()

    @classmethod
    def for_mode(cls, mode: str, *, max_staleness: int, groups_per_step: int, **kwargs) -> "StalenessAdmission":
        return cls(groups_per_step=groups_per_step, max_staleness=staleness_bound(mode, max_staleness), **kwargs)

    def capacity(self) -> int:
        """Groups this explorer may start now (<= 0: none)."""
        with self._lock:
            return self._capacity()

    def fleet_capacity(self) -> int:
        """(k + version + 1) * B - accepted_fleet: what the whole fleet may still start, as of the last reading."""
        with self._lock:
            return fleet_capacity(self.max_staleness, self._state.version, self.groups_per_step, self._fleet_accepted)

    def admit(self, n: int) -> int:
        """Admit up to `n` groups (reading the feed first when due); returns how many (they count as running)."""
        if n < 0:
            raise ValueError(f"reserve: n must be >= 0, got {n}")
        reading = self._read_feed()
        with self._lock:
            if reading is not None:
                self._resync(reading)
            granted = max(0, min(n, self._capacity()))
            self._update(running=self._state.running + granted)
            return granted

    reserve = admit

    def finish(self, n: int = 1) -> None:
        """`n` admitted groups were written to the experiences topic."""
        with self._lock:
            self._release(n, "finish")
            self._update(accepted=self._state.accepted + n)

    def fail(self, n: int = 1) -> None:
        """`n` admitted groups were given up (their tasks will be explored again); their slots are free."""
        with self._lock:
            self._release(n, "fail")

    def set_version(self, version: int) -> None:
        """This explorer now generates with weights `version` (never decreases)."""
        with self._lock:
            if version < self._state.version:
                raise ValueError(f"set_version: version {version} is older than the current {self._state.version}")
            self._update(version=version)

    def resync(self, *, trainer_version: int, backlog: int, explorers: int = 1, rank: int = 0) -> None:
        """Recount the fleet's accepted groups from a reading (see the module docstring)."""
        with self._lock:
            self._resync(FleetReading(trainer_version=trainer_version, backlog=backlog, explorers=explorers,
                                      rank=rank))

    def wait(self, timeout_s: float) -> bool:
        """Block until the feed has news (then the next `admit` reads it at once, whatever `refresh_s` says) or
        `timeout_s` passes; True on news. Without a feed that can wait, sleeps. What makes sync mode pay no polling
        interval: an explorer refused for want of the trainer's next version wakes on its announcement."""
        wait = getattr(self.feed, "wait", None)
        if wait is None or self.max_staleness is None:
            time.sleep(timeout_s)
            return False
        news = wait(timeout_s)
        if news:
            self._last_read = -float("inf")
        return news

    def state(self) -> AdmissionState:
        with self._lock:
            return self._state

    def close(self) -> None:
        if self.feed is not None:
            self.feed.close()

    def _read_feed(self) -> FleetReading | None:
        if self.feed is None or self.max_staleness is None or time.monotonic() - self._last_read < self.refresh_s:
            return None
        self._last_read = time.monotonic()
        return self.feed.read()

    def _resync(self, reading: FleetReading) -> None:
        if (reading.trainer_version < 0 or reading.backlog < 0 or reading.explorers < 1
                or not 0 <= reading.rank < reading.explorers):
            raise ValueError("resync: trainer_version and backlog must be >= 0, explorers >= 1 and 0 <= rank < "
                             f"explorers, got {reading}")
        self._fleet_accepted = reading.trainer_version * self.groups_per_step + reading.backlog
        self._explorers, self._rank = reading.explorers, reading.rank
        self._update(accepted=self._fleet_accepted)

    def _capacity(self) -> int:
        s = self._state
        by_concurrency = sys.maxsize if self.max_running is None else self.max_running - s.running
        if self.max_staleness is None:
            return by_concurrency
        here = s.accepted - self._fleet_accepted + s.running
        return min(by_concurrency, capacity(self.max_staleness, s.version, self.groups_per_step, self._fleet_accepted,
                                            explorers=self._explorers, rank=self._rank, here=here))

    def _release(self, n: int, what: str) -> None:
        if not 0 <= n <= self._state.running:
            raise ValueError(f"{what}({n}) with {self._state.running} groups running")
        self._update(running=self._state.running - n)

    def _update(self, **changes: int) -> None:
        self._state = dataclasses.replace(self._state, **changes)


def fleet_capacity(max_staleness: int, version: int, groups_per_step: int, accepted_fleet: int) -> int:
    """AReaL's bound for the whole fleet, (k + version + 1) * B - accepted_fleet (module docstring): the groups it may
    still start so that none is trained more than k = `max_staleness` versions after `version`. May be <= 0."""
    return (max_staleness + version + 1) * groups_per_step - accepted_fleet


def capacity(max_staleness: int, version: int, groups_per_step: int, accepted_fleet: int, *, explorers: int = 1,
             rank: int = 0, here: int = 0) -> int:
    """The formula of the module docstring, the one place it is written (StalenessAdmission and the fleet simulator,
    rft/bench/simulate.py, both call it): the groups the explorer of `rank` among `explorers` may start now,
    share(fleet_capacity(...)) - here, `here` = accepted_here + running. <= 0: none."""
    return share(fleet_capacity(max_staleness, version, groups_per_step, accepted_fleet), explorers, rank) - here


def share(capacity: int, explorers: int, rank: int) -> int:
    """The part of `capacity` (may be <= 0) that the explorer of `rank` (0-based) among `explorers` may start:
    the parts of ranks 0..explorers-1 add up to `capacity` (module docstring)."""
    if capacity <= 0:
        return capacity // explorers
    return capacity // explorers + (1 if rank < capacity % explorers else 0)


# ------------------------------------------------------------------------------------------------ the Kafka feed

class KafkaFleetFeed:
    """Readings from Kafka: the control topic replayed from its beginning into a ControlView, and the experiences
    topic's end offsets. On a transport failure the source is rebuilt and `read()` returns None."""

    def __init__(self, transport: Transport, *, control_topic: str, experiences_topic: str, client_id: str,
                 live_horizon_s: float, explorer_id: str = ""):
        self.transport, self.client_id, self.explorer_id = transport, client_id, explorer_id
        self.control_topic, self.experiences_topic = control_topic, experiences_topic
        self.live_horizon_s = live_horizon_s
        self.view = ControlView()
        self._experience_ends: dict[str, int] = {}
        self._source = self._open()

    def _open(self) -> RecordSource:
        source = self.transport.source(client_id=self.client_id)
        source.assign([self.control_topic])
        source.seek(source.beginning_offsets(self.control_topic))
        return source

    def read(self) -> FleetReading | None:
        try:
            records = self._source.poll(timeout_s=0, max_records=10_000)
            self.view.apply_records(m for m in records if m.topic == self.control_topic)
            self._experience_ends = self._source.end_offsets(self.experiences_topic)
        except TransportError as e:
            log.warning("admission: %s; reconnecting", e)
            old, self._source = self._source, self._open()
            try:
                old.close()
            except Exception:
                pass
            return None
        live = self.view.live_explorer_ids(time.time(), self.live_horizon_s)
        if self.explorer_id not in live:  # not heard from itself yet: counted, last
            live.append(self.explorer_id)
        return FleetReading(trainer_version=self.view.trainer.version, backlog=self.backlog(),
                            explorers=len(live), rank=live.index(self.explorer_id))

    def wait(self, timeout_s: float) -> bool:
        """Block on the control topic until a message arrives (applied to the view; True) or `timeout_s` passes
        (False). The broker answers a fetch as soon as a record is there, so this wakes within milliseconds of
        the trainer's announcement."""
        deadline = time.monotonic() + timeout_s
        try:
            while (left := deadline - time.monotonic()) > 0:
                records = [m for m in self._source.poll(timeout_s=left, max_records=10_000)
                           if m.topic == self.control_topic]
                if records:
                    self.view.apply_records(records)
                    return True
        except TransportError as e:
            log.warning("admission: %s while waiting for the control topic", e)
        return False

    def backlog(self) -> int:
        """Experience records produced and not consumed by the trainer (as it last announced)."""
        return lag(self._experience_ends, self.view.trainer.offsets)

    def close(self) -> None:
        self._source.close()


def fleet_admission(mode: str, *, max_staleness: int, groups_per_step: int, transport: Transport,
                    control_topic: str, experiences_topic: str, explorer_id: str,
                    heartbeat_s: float) -> StalenessAdmission:
    """`explorer.admission: staleness` for one explorer: the mode's bound, fed from Kafka when there is one."""
    bound = staleness_bound(mode, max_staleness)
    feed = None if bound is None else KafkaFleetFeed(
        transport, control_topic=control_topic, experiences_topic=experiences_topic,
        client_id=f"{explorer_id}-admission", live_horizon_s=3 * heartbeat_s, explorer_id=explorer_id)
    return StalenessAdmission(groups_per_step=groups_per_step, max_staleness=bound, feed=feed)
