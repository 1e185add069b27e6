"""Admission control at the explorers: how many rollouts may start now (`explorer.admission`).

`Admission` is the interface the explorer calls (every method); `AdmitAll` (`all`) lets every task start; a plugin
(`package.module:factory`) returns an object with every method of `Admission` (checked when the explorer is composed).

`StalenessAdmission` (`staleness`, the default) is AReaL's staleness manager, counted in groups and shared by the
fleet. With B = run.groups_per_step and k the run mode's admission bound (rft.modes.admission_bound: the mode's
staleness bound, or async's `run.async_max_staleness`), an explorer may start

    capacity = share((k + version + 1) * B - accepted_fleet) - (accepted_here + running)

groups now (`capacity`, the one place the formula is written; `StalenessAdmission` defines each term, says why it
bounds staleness by k and how it counts the groups the trainer drops). With a fleet, the groups the other explorers
run are counted through an admission log on the control topic, Kafka as the sequencer (`AdmissionLedger`: its rule
and why it keeps the bound); `KafkaFleetFeed` reads the fleet (the trainer's announcements, the live explorers, the
experiences' backlog) from Kafka. Unit tests drive the same objects with in-memory feeds (tests/unit/test_staleness.py,
tests/unit/test_admission_ledger.py); tests/integration/test_admission.py runs the ledger on the real broker.
"""
from __future__ import annotations

import bisect
import dataclasses
import itertools
import logging
import math
import sys
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol, cast, runtime_checkable

from rft.config import ConfigError
from rft.modes import admission_bound
from rft.schema import ControlMessage, RecordError, decode, encode
from rft.transport import RecordSource, Transport, TransportError, lag
from rft.transport.control import (
    ADMISSION_PARTITION,
    KEEP_METRIC,
    AdmissionClaim,
    AdmissionRelease,
    ControlError,
    ControlView,
    Kind,
    parse,
)

CLAIM_TIMEOUT_S = 10.0  # longest wait for a claim to come back from the broker; then it counts as refused
KEEP_FLOOR = 0.1  # counting drops, the explorers start at most 1 / KEEP_FLOOR groups per slot
# counting drops, the keep fraction admission uses is the trainer's plus this: a noisy estimate over 4 steps of 4 groups
# otherwise over-admits (tests/unit/test_staleness.py's simulation; docs/benchmarks.md has what each margin costs)
KEEP_MARGIN = 0.1

log = logging.getLogger(__name__)


class Admission(Protocol):
    """How many rollouts may start now. The explorer calls every method (rft/explorer/pipeline.py, parts.py):
      admit(n)          before starting tasks, with the number at hand: how many may start, 0 <= result <= n;
      finish(n)         n admitted groups were acknowledged by the broker (n > 0);
      fail(n)           n admitted tasks were given up, e.g. dead-lettered (n > 0);
      set_version(v)    weights v were loaded (v never decreases);
      wait(timeout_s)   after an admit that let nothing start: block until something may change the answer
                        (StalenessAdmission: a control message, e.g. the trainer's next version) or `timeout_s`
                        passes; True on news;
      close()           the explorer leaves.
    A plugin (`explorer.admission: package.module:factory`) returns an object with all of them: `checked` refuses
    one that lacks any, by name, when the explorer is composed."""

    def admit(self, n: int) -> int: ...
    def finish(self, n: int) -> None: ...
    def fail(self, n: int) -> None: ...
    def set_version(self, version: int) -> None: ...
    def wait(self, timeout_s: float) -> bool: ...
    def close(self) -> None: ...


ADMISSION_METHODS = tuple(name for name, value in vars(Admission).items() if callable(value) and name[0] != "_")


def checked(admission: object, *, key: str = "explorer.admission") -> Admission:
    """`admission` as an `Admission`; ConfigError naming `key` and every method it lacks."""
    missing = [name for name in ADMISSION_METHODS if not callable(getattr(admission, name, None))]
    if missing:
        raise ConfigError(f"{key}: {type(admission).__name__} lacks {', '.join(missing)} (every method of the "
                          "Admission interface, rft/explorer/admission.py)")
    return cast(Admission, admission)


class AdmitAll:
    """`explorer.admission: all`: every task may start; the notifications change nothing."""

    def admit(self, n: int) -> int:
        return n

    def finish(self, n: int) -> None:
        pass

    def fail(self, n: int) -> None:
        pass

    def set_version(self, version: int) -> None:
        pass

    def wait(self, timeout_s: float) -> bool:
        time.sleep(timeout_s)
        return False

    def close(self) -> None:
        pass


# ------------------------------------------------------------------------------------------------ the formula

@dataclass(frozen=True)
class AdmissionState:
    version: int
    accepted: int  # accepted_fleet + accepted_here
    running: int


@dataclass(frozen=True)
class FleetReading:
    """What the fleet says now: the trainer's newest version, the groups produced and not consumed yet, and
    the live explorers sharing the capacity. `seen`: with a ledger, the position of the admission log (control
    partition 0) the reading was taken after (AdmissionLedger); None without one."""
    trainer_version: int
    backlog: int
    explorers: int = 1
    rank: int = 0  # this explorer's place among them (`share`)
    seen: int | None = None
    in_batch: int = 0  # groups the trainer took into the step it waits to complete (StalenessAdmission)
    keep: float = 1.0  # the share of recent groups the trainer kept (its `keep_fraction`; 1.0 before it said)


class FleetFeed(Protocol):
    """A source of readings: `read()` returns a new reading, or None when there is nothing new or it cannot
    be read now (the last reading stays in force: admission errs on the side of waiting). Optional:
    `wait(timeout_s) -> bool`, block until news arrives (True) or `timeout_s` passes (False). A feed with a ledger
    (`ledger`, an AdmissionLedger folded up to its readings' `seen`) also has `claim(groups, limit, seen, version)
    -> granted` (one claim through the admission log, its grant once read back) and `release(groups)`."""

    def read(self) -> FleetReading | None: ...
    def close(self) -> None: ...


@runtime_checkable
class WaitingFeed(Protocol):
    """A `FleetFeed` that can wait for news (`FleetFeed`'s docstring)."""

    def wait(self, timeout_s: float) -> bool: ...


@runtime_checkable
class LedgerFeed(Protocol):
    """A `FleetFeed` with a ledger, which takes claims (`FleetFeed`'s docstring; KafkaFleetFeed)."""

    ledger: AdmissionLedger

    def claim(self, groups: int, *, limit: int, seen: int, version: int) -> int: ...
    def release(self, groups: int) -> None: ...


# ------------------------------------------------------------------------------------------------ the ledger

class AdmissionLedger:
    """The fold of the admission log: `admission_claim` and `admission_release` messages in log order (control
    partition 0, by offset), by the rule below. Deterministic: every explorer folding the same log gets the
    same grants. Not thread-safe.

    `apply(offset, kind)` applies one message (offsets below `position` were applied already and are ignored) and
    returns a claim's grant (None for a release); `outstanding` holds the groups granted to each explorer and not
    released; `outstanding_at(seen)` is the fleet's outstanding as a claim that read the fleet at `seen` counts it.

    A fleet: the ledger. Several explorers read the fleet at different moments, and the groups the others are running
    are in no reading: each dividing what is left of the capacity without counting them starts more than the bound
    (docs/benchmarks.md). So the fleet counts what is running through the
    control topic, with Kafka as the sequencer (`AdmissionLedger`): an explorer that wants to start groups writes an
    `admission_claim` {groups wanted, limit, seen} to control partition 0, where `limit` = (k + version + 1) * B -
    accepted_fleet is the capacity as it read the fleet, and `seen` a partition-0 offset below which every record was
    written before that reading (the records it had folded, and those before its own newest acknowledged release);
    every group it starts it later gives back with an `admission_release` (produced or given up). Every explorer folds
    partition 0 in offset order, the same log for all, so all agree on each claim's grant:

        outstanding_i = (groups granted by the claims before i) - (groups released at offsets below seen_i)
        granted_i     = clamp(limit_i - outstanding_i, 0, groups_i)

    A claimer learns its grant by reading its own claim back (one round trip). Why it holds the bound: every release
    below seen_i was written before the reading behind limit_i read the experiences' end offsets, and a release is
    written after its group was acknowledged, so those groups are in accepted_fleet; groups released at or after seen_i
    are still counted as outstanding (at worst twice: conservative, for one reading). So accepted + outstanding +
    granted never exceeds (k + version + 1) * B, whoever claims, in any interleaving. What an explorer asks for is the
    capacity formula above (its share, less what it runs), so a version's groups are still spread over the fleet; the
    ledger grants what the others' outstanding groups leave of it. A claim the claimer gave up waiting for
    (CLAIM_TIMEOUT_S) and that the log later grants is released at once. Outstanding groups of an explorer that stopped
    without releasing them: it releases them all (`reset`) when it starts again or leaves, and a live explorer releases
    those of an explorer silent for the liveness horizon (`by`), once. Heartbeats carrying running counts were the other
    design: a count is as old as its heartbeat, two explorers can still fill the same slots between heartbeats, and
    there is no order to agree on; the ledger costs a round trip per admission and two small messages per started group
    on the control topic (keep its retention unlimited: every explorer replays it)."""

    def __init__(self) -> None:
        self.position = 0  # the next log offset to apply
        self.granted = 0  # groups granted by every claim applied
        self.released = 0  # groups released by every release applied
        self.outstanding: dict[str, int] = {}
        self._releases: list[tuple[int, int]] = []  # (offset + 1, `released` after it), ascending

    def outstanding_at(self, seen: int) -> int:
        """Groups granted so far minus those released at offsets below `seen`."""
        i = bisect.bisect_right(self._releases, (seen, float("inf")))
        return self.granted - (self._releases[i - 1][1] if i else 0)

    def apply(self, offset: int, kind: Kind) -> int | None:
        if offset < self.position:
            return None
        self.position = offset + 1
        if isinstance(kind, AdmissionClaim):
            granted = max(0, min(kind.groups, kind.limit - self.outstanding_at(kind.seen)))
            self.granted += granted
            self.outstanding[kind.explorer_id] = self.outstanding.get(kind.explorer_id, 0) + granted
            return granted
        if isinstance(kind, AdmissionRelease):
            held = self.outstanding.get(kind.explorer_id, 0)
            freed = held if kind.reset else max(0, min(kind.groups, held))
            if freed:
                self.outstanding[kind.explorer_id] = held - freed
                self.released += freed
                self._releases.append((offset + 1, self.released))
        return None


class StalenessAdmission:
    """The formula of the module docstring. Thread-safe (one lock around the counters; the feed is read, and claims
    are made, outside it). Use: `n = admit(wanted)` (alias `reserve`) before starting rollouts, then `finish(k)` for
    groups written to the experiences topic and `fail(k)` for groups given up; `set_version(v)` after loading weights
    v. With a feed that takes claims (its `ledger`), admissions go through the fleet's ledger; otherwise the count is
    this explorer's own (below).

    An explorer may start capacity = share((k + version + 1) * B - accepted_fleet) - (accepted_here + running)
    groups now, where
      version         the weights version this explorer generates with (`set_version`);
      accepted_fleet  = trainer_version * B + in_batch + backlog, the training slots taken as of the last reading of
                      the fleet: trainer_version is the trainer's newest version, in_batch the groups it has taken into
                      the step it waits to complete (its `trainer_waiting` says how many; 0 at a step's end), backlog
                      the experience groups produced but not yet consumed by the trainer (the experiences topic's end
                      offsets minus the trainer's consumed offsets, as last announced; those offsets include in_batch's
                      groups, which is why they are counted apart: without them a waiting trainer's partial step made
                      the bound look larger by up to B - 1 groups);
      explorers       the live explorers sharing the capacity (>= 1);
      share(c)        this explorer's part of c: c // explorers, plus one more for the `c % explorers` lowest ranks
                      (rank: its place among the live explorers' ids, sorted; one not heard from yet comes last),
                      so the parts add up to c exactly and a fleet larger than c still starts c groups (a plain
                      c // explorers gives every member 0 once explorers > c: in sync mode a fleet larger than
                      groups_per_step would never start anything);
      accepted_here   groups this explorer finished (acknowledged by the broker) since that reading;
      running         groups it admitted and has not finished or given up.
    With one explorer this is AReaL's (k + version + 1) * B - (accepted + running), accepted = accepted_fleet +
    accepted_here; without a bound only `max_running` (if any) limits. With a fleet, accepted_here + running is replaced
    by the fleet's outstanding groups, counted by the ledger below.

    Why it bounds staleness: the trainer takes B groups per step in arrival order, so the j-th slot (1-based) is
    trained in step ceil(j / B). A group admitted at version w holds one of the first (k + w + 1) * B slots, so if
    groups finish in the order they were admitted it is trained in a step s <= k + w + 1, i.e. with staleness <= k.
    A straggler overtaken by later rollouts can still exceed k; the trainer's StalenessTracker drops and counts it.
    With in-flight weight updates (rft/explorer/continuous.py) a group admitted at w has no token older than w, so its
    staleness (its oldest token's) obeys the same bound.

    Groups the trainer drops (`explorer.admission_counts_drops`, default true). The trainer's operators drop groups (the
    zero-variance filter), and a dropped group takes no slot. Counting each admitted group as a slot, the explorers stop
    once a step's B groups are made, the trainer drops some, waits for replacements, announces that it waits, and only
    then are they admitted and generated (docs/benchmarks.md has what the trainer waited so). So the trainer announces
    `keep_fraction` with each step (the share of its fresh groups kept over its last 4 steps; stale drops not counted),
    and with keep q < 1 the slots not yet taken by trained groups, slots = (k + version + 1) * B - trainer_version * B -
    in_batch, are filled by floor(slots / q) groups, of which the backlog is made already (`fleet_capacity`; q is the
    trainer's keep fraction plus KEEP_MARGIN, clamped to [KEEP_FLOOR, 1]). The bound then holds in expectation at
    admission, and exactly at the trainer: a group left over when the trainer kept more than q of them trains in a later
    step, and one past the bound is dropped as stale by the trainer's StalenessTracker (counted as `dropped_stale`).
    With q = 1 (no operator drops, or before the first step, or the option off) the formula is the one above and its
    proof holds as written."""

    def __init__(self, *, groups_per_step: int, max_staleness: int | None, version: int = 0,
                 accepted: int = 0, max_running: int | None = None, feed: FleetFeed | None = None,
                 refresh_s: float = 0.5, counts_drops: bool = False):
        """`counts_drops`: expect the trainer to drop the share of groups its readings say (`FleetReading.keep`,
        "Groups the trainer drops" in the class docstring); False: every group takes a slot."""
        if groups_per_step < 1:
            raise ValueError(f"run.groups_per_step: must be >= 1, got {groups_per_step}")
        if max_running is not None and max_running < 1:
            raise ValueError(f"max_running: must be >= 1 or None, got {max_running}")
        self.groups_per_step, self.max_staleness, self.max_running = groups_per_step, max_staleness, max_running
        self.feed, self.refresh_s, self.counts_drops = feed, refresh_s, counts_drops
        self._backlog, self._keep = 0, 1.0  # of the reading in force
        self._state = AdmissionState(version=version, accepted=accepted, running=0)
        self._fleet_accepted, self._explorers, self._rank = accepted, 1, 0
        self._seen: int | None = None  # the ledger position of the reading in force (None: no reading yet)
        self._claims = feed if isinstance(feed, LedgerFeed) and max_staleness is not None else None
        self._last_read = -float("inf")
        self._lock = threading.Lock()

    @classmethod
    def for_mode(cls, mode: str, *, max_staleness: int, groups_per_step: int,
                 async_max_staleness: int | None = None, **kwargs) -> StalenessAdmission:
        """Admission at mode `mode`'s admission bound (rft.modes.admission_bound)."""
        bound = admission_bound(mode, max_staleness, async_max_staleness)
        return cls(groups_per_step=groups_per_step, max_staleness=bound, **kwargs)

    def capacity(self) -> int:
        """Groups this explorer may start now (<= 0: none)."""
        with self._lock:
            return self._capacity()

    def fleet_capacity(self) -> int:
        """(k + version + 1) * B - accepted_fleet: what the whole fleet may still start, as of the last reading."""
        with self._lock:
            return self._fleet_capacity()

    def admit(self, n: int) -> int:
        """Admit up to `n` groups (reading the feed first when due); returns how many (they count as running)."""
        if n < 0:
            raise ValueError(f"reserve: n must be >= 0, got {n}")
        reading = self._read_feed()
        with self._lock:
            if reading is not None:
                self._resync(reading)
            wanted = max(0, min(n, self._capacity()))
            if self._claims is None or not wanted:
                self._update(running=self._state.running + wanted)
                return wanted
            claims, limit, seen, version = self._claims, self._fleet_capacity(), self._seen, self._state.version
        assert seen is not None  # _capacity() is 0 without a reading of the fleet
        granted = max(0, min(wanted, claims.claim(wanted, limit=limit, seen=seen, version=version)))  # a round trip
        with self._lock:
            self._update(running=self._state.running + granted)
        return granted

    reserve = admit

    def finish(self, n: int = 1) -> None:
        """`n` admitted groups were written to the experiences topic."""
        with self._lock:
            self._release(n, "finish")
            self._update(accepted=self._state.accepted + n)
        self._give_back(n)

    def fail(self, n: int = 1) -> None:
        """`n` admitted groups were given up (their tasks will be explored again); their slots are free."""
        with self._lock:
            self._release(n, "fail")
        self._give_back(n)

    def _give_back(self, n: int) -> None:
        """Release `n` granted groups through the ledger (with one)."""
        if self._claims is not None and n:
            self._claims.release(n)

    def set_version(self, version: int) -> None:
        """This explorer now generates with weights `version` (never decreases)."""
        with self._lock:
            if version < self._state.version:
                raise ValueError(f"set_version: version {version} is older than the current {self._state.version}")
            self._update(version=version)

    def resync(self, *, trainer_version: int, backlog: int, explorers: int = 1, rank: int = 0,
               in_batch: int = 0) -> None:
        """Recount the fleet's accepted groups from a reading (the class docstring)."""
        with self._lock:
            self._resync(FleetReading(trainer_version=trainer_version, backlog=backlog, explorers=explorers,
                                      rank=rank, in_batch=in_batch))

    def wait(self, timeout_s: float) -> bool:
        """Block until the feed has news (then the next `admit` reads it at once, whatever `refresh_s` says) or
        `timeout_s` passes; True on news. Without a feed that can wait, sleeps. What makes sync mode pay no polling
        interval: an explorer refused for want of the trainer's next version wakes on its announcement."""
        if not isinstance(self.feed, WaitingFeed) or self.max_staleness is None:
            time.sleep(timeout_s)
            return False
        news = self.feed.wait(timeout_s)
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
        if (reading.trainer_version < 0 or reading.backlog < 0 or reading.in_batch < 0 or reading.explorers < 1
                or not 0 <= reading.rank < reading.explorers):
            raise ValueError("resync: trainer_version, backlog and in_batch must be >= 0, explorers >= 1 and 0 <= "
                             f"rank < explorers, got {reading}")
        self._fleet_accepted = reading.trainer_version * self.groups_per_step + reading.in_batch + reading.backlog
        self._explorers, self._rank, self._seen = reading.explorers, reading.rank, reading.seen
        self._backlog = reading.backlog
        self._keep = (min(1.0, max(KEEP_FLOOR, reading.keep + KEEP_MARGIN))
                      if self.counts_drops and math.isfinite(reading.keep) else 1.0)
        self._update(accepted=self._fleet_accepted)

    def _fleet_capacity(self) -> int:
        if self.max_staleness is None:
            return sys.maxsize
        return fleet_capacity(self.max_staleness, self._state.version, self.groups_per_step, self._fleet_accepted,
                              backlog=self._backlog, keep=self._keep)

    def _capacity(self) -> int:
        """Groups this explorer may start now (with a ledger: may ask for, its share; the ledger grants what the
        fleet's outstanding groups leave); <= 0: none."""
        s = self._state
        by_concurrency = sys.maxsize if self.max_running is None else self.max_running - s.running
        if self.max_staleness is None:
            return by_concurrency
        if self._claims is not None and self._seen is None:
            return 0  # no reading of the fleet yet: nothing to claim against
        here = s.accepted - self._fleet_accepted + s.running
        return min(by_concurrency, share(self._fleet_capacity(), self._explorers, self._rank) - here)

    def _release(self, n: int, what: str) -> None:
        if not 0 <= n <= self._state.running:
            raise ValueError(f"{what}({n}) with {self._state.running} groups running")
        self._update(running=self._state.running - n)

    def _update(self, **changes: int) -> None:
        self._state = dataclasses.replace(self._state, **changes)


def fleet_capacity(max_staleness: int, version: int, groups_per_step: int, accepted_fleet: int, *, backlog: int = 0,
                   keep: float = 1.0) -> int:
    """AReaL's bound for the whole fleet, (k + version + 1) * B - accepted_fleet (module docstring): the groups it may
    still start so that none is trained more than k = `max_staleness` versions after `version`. May be <= 0.
    With `keep` < 1 (the share of groups the trainer keeps, its operators dropping the rest: "Groups the trainer
    drops" in StalenessAdmission), the slots not yet taken by trained groups, slots = (k + version + 1) * B -
    (accepted_fleet - backlog), are filled by slots / keep groups, of which the `backlog` are made already."""
    if keep >= 1:
        return (max_staleness + version + 1) * groups_per_step - accepted_fleet
    slots = (max_staleness + version + 1) * groups_per_step - (accepted_fleet - backlog)
    return (math.floor(slots / keep) if slots > 0 else slots) - backlog


def capacity(max_staleness: int, version: int, groups_per_step: int, accepted_fleet: int, *, explorers: int = 1,
             rank: int = 0, here: int = 0, backlog: int = 0, keep: float = 1.0) -> int:
    """The formula of the module docstring, the one place it is written (StalenessAdmission and the fleet simulator,
    benchmarks/simulate.py, both call it): the groups the explorer of `rank` among `explorers` may start now,
    share(fleet_capacity(...)) - here, `here` = accepted_here + running. <= 0: none."""
    return share(fleet_capacity(max_staleness, version, groups_per_step, accepted_fleet, backlog=backlog, keep=keep),
                 explorers, rank) - here


def share(capacity: int, explorers: int, rank: int) -> int:
    """The part of `capacity` (may be <= 0) that the explorer of `rank` (0-based) among `explorers` may start:
    the parts of ranks 0..explorers-1 add up to `capacity`."""
    if capacity <= 0:
        return capacity // explorers
    return capacity // explorers + (1 if rank < capacity % explorers else 0)


# ------------------------------------------------------------------------------------------------ the Kafka feed

class KafkaFleetFeed:
    """Readings from Kafka: the control topic replayed from its beginning into a ControlView and the admission ledger
    (its partition 0), and the experiences topic's end offsets; claims and releases written to control partition 0
    (AdmissionLedger). On a transport failure the source is rebuilt and `read()` returns None. Used from one thread
    (the explorer's loop).

    Where the reading comes from: a `FleetFeed`. In production `KafkaFleetFeed` replays the control topic into a
    ControlView and the ledger (the trainer announces its version and consumed offsets after every step and, while it
    waits for data, every few seconds, so records it skipped never block admission; explorers are live when heard from
    within three heartbeat intervals) and reads the experiences topic's end offsets, at most every `refresh_s`; an
    explorer that admission refused waits on the control topic (`wait`) and reads again as soon as a message other than
    a claim or a release arrives. Without a feed that takes claims (one explorer, the unit tests) the count is local: a
    reading rebuilds it (`resync`), and `accepted_here` + `running` stand for the fleet's outstanding. Rollouts that
    were running in a dead explorer are gone (their tasks are re-explored), so `running` restarts at 0. Counting slots
    rather than all groups ever accepted matters because groups the trainer drops never take a slot. A restarted
    trainer announces its rewound offsets, the backlog grows by what it will consume again, and admission tightens by
    itself. Unit tests drive the same objects with in-memory feeds (tests/unit/test_staleness.py,
    tests/unit/test_admission_ledger.py); tests/integration/test_admission.py runs the ledger on the real broker.
"""

    def __init__(self, transport: Transport, *, control_topic: str, experiences_topic: str, client_id: str,
                 live_horizon_s: float, explorer_id: str = ""):
        self.transport, self.client_id, self.explorer_id = transport, client_id, explorer_id
        self.control_topic, self.experiences_topic = control_topic, experiences_topic
        self.live_horizon_s = live_horizon_s
        self.view = ControlView()
        self.ledger = AdmissionLedger()
        self._experience_ends: dict[str, int] = {}
        self._sink = transport.sink(client_id=client_id)
        self._claim_ids = (f"{explorer_id}/{time.time_ns():x}/{i}" for i in itertools.count())
        self._grants: dict[str, int] = {}  # this explorer's claims read back, until `claim` takes them
        self._waiting: set[str] = set()  # its claims `claim` is waiting for; the others it gave up on
        self._reclaiming: set[str] = set()  # silent explorers whose outstanding groups it released
        self._released_through = 0  # one past the log offset of its newest release the broker acknowledged
        self._source = self._open()
        self._send(AdmissionRelease(explorer_id=explorer_id, reset=True))  # a restart runs nothing yet

    def _open(self) -> RecordSource:
        source = self.transport.source(client_id=self.client_id)
        source.assign([self.control_topic])
        source.seek(source.beginning_offsets(self.control_topic))
        return source

    def read(self) -> FleetReading | None:
        try:
            self._apply(self._source.poll(timeout_s=0, max_records=10_000))
            # every admission record below `seen` was written before the experiences' end offsets are read (those it
            # folded, and those before its own newest release), so a release below it has its group in this
            # reading's backlog (AdmissionLedger)
            seen = max(self.ledger.position, self._released_through)
            self._experience_ends = self._source.end_offsets(self.experiences_topic)
        except TransportError as e:
            self._reconnect(e)
            return None
        live = self.view.live_explorer_ids(time.time(), self.live_horizon_s)
        self._reclaim_silent(set(live))
        if self.explorer_id not in live:  # not heard from itself yet: counted, last
            live.append(self.explorer_id)
        return FleetReading(trainer_version=self.view.trainer.version, backlog=self.backlog(),
                            explorers=len(live), rank=live.index(self.explorer_id), seen=seen,
                            in_batch=self.view.trainer.groups_in_batch,
                            keep=self.view.trainer.metrics.get(KEEP_METRIC, 1.0))

    def claim(self, groups: int, *, limit: int, seen: int, version: int) -> int:
        """Ask the ledger for `groups` groups under `limit` (the capacity read at `seen`); the grant, once this
        claim is read back from the log; 0 when it is not back within CLAIM_TIMEOUT_S (a grant that comes later is
        released at once) or the broker fails."""
        claim_id = next(self._claim_ids)
        self._waiting.add(claim_id)
        deadline = time.monotonic() + CLAIM_TIMEOUT_S
        try:
            self._send(AdmissionClaim(explorer_id=self.explorer_id, claim_id=claim_id, groups=groups, limit=limit,
                                      seen=seen, version=version))
            self._sink.flush(timeout_s=CLAIM_TIMEOUT_S)
            while claim_id not in self._grants and (left := deadline - time.monotonic()) > 0:
                self._apply(self._source.poll(timeout_s=min(left, 0.5), max_records=10_000))
        except TransportError as e:
            self._reconnect(e)
        self._waiting.discard(claim_id)
        if claim_id not in self._grants:
            log.warning("admission: claim %s was not read back within %.0f s; counted as refused", claim_id,
                        CLAIM_TIMEOUT_S)
        return self._grants.pop(claim_id, 0)

    def release(self, groups: int) -> None:
        """`groups` of this explorer's granted groups ended: written before it returns, so the next reading's log
        end is past it (a failure is logged: the groups stay outstanding until this explorer's reset)."""
        try:
            written = self._send(AdmissionRelease(explorer_id=self.explorer_id, groups=groups))
            self._released_through = max(self._released_through, written.get(timeout=CLAIM_TIMEOUT_S).offset + 1)
        except TransportError as e:
            log.warning("admission: a release of %d groups was not written (%s)", groups, e)

    def wait(self, timeout_s: float) -> bool:
        """Block on the control topic until a message other than a claim or a release arrives (applied; True) or
        `timeout_s` passes (False). The broker answers a fetch as soon as a record is there, so this wakes within
        milliseconds of the trainer's announcement."""
        deadline = time.monotonic() + timeout_s
        try:
            while (left := deadline - time.monotonic()) > 0:
                if self._apply(self._source.poll(timeout_s=left, max_records=10_000)):
                    return True
        except TransportError as e:
            log.warning("admission: %s while waiting for the control topic", e)
        return False

    def backlog(self) -> int:
        """Experience records produced and not consumed by the trainer (as it last announced)."""
        return lag(self._experience_ends, self.view.trainer.offsets)

    def close(self) -> None:
        """Release whatever this explorer still holds (`reset`), then close the clients."""
        try:
            self._send(AdmissionRelease(explorer_id=self.explorer_id, reset=True))
            self._sink.flush(timeout_s=10)
        except TransportError as e:
            log.warning("admission: the final release was not written (%s); the fleet reclaims it", e)
        finally:
            self._sink.close()
            self._source.close()

    def _apply(self, records: Iterable) -> bool:
        """Apply control records in order: admission messages of partition 0 to the ledger, the others to the view;
        True when any of the others was there."""
        news, now = False, time.time()
        for m in records:
            if m.topic != self.control_topic:
                continue
            try:
                message = decode(m.value, m.headers)
                kind = parse(message) if isinstance(message, ControlMessage) else None
            except (RecordError, ControlError):
                kind = message = None
            if isinstance(kind, (AdmissionClaim, AdmissionRelease)):
                if m.partition == ADMISSION_PARTITION:
                    self._ledger_apply(m.offset, kind)
            elif isinstance(message, ControlMessage):
                self.view.apply(message, received_at=now)  # counts a malformed one
                news = True
        return news

    def _ledger_apply(self, offset: int, kind: Kind) -> None:
        granted = self.ledger.apply(offset, kind)
        if isinstance(kind, AdmissionClaim) and kind.explorer_id == self.explorer_id and granted is not None:
            if kind.claim_id in self._waiting:
                self._grants[kind.claim_id] = granted
            elif granted:  # a claim it gave up on (or a former incarnation's): nothing runs under it
                self.release(granted)
        elif isinstance(kind, AdmissionRelease) and kind.reset:
            self._reclaiming.discard(kind.explorer_id)

    def _reclaim_silent(self, live: set[str]) -> None:
        """Release, once, the outstanding groups of explorers that are not live (silent or left)."""
        for explorer, held in self.ledger.outstanding.items():
            if held > 0 and explorer != self.explorer_id and explorer not in live and explorer not in self._reclaiming:
                self._reclaiming.add(explorer)
                log.info("admission: releasing %d groups of %s (not live)", held, explorer)
                self._send(AdmissionRelease(explorer_id=explorer, reset=True, by=self.explorer_id))

    def _send(self, kind: Kind):
        """Write `kind` to the admission log (control partition 0); its send future."""
        value, headers = encode(kind.to_message())
        return self._sink.send(self.control_topic, value, headers=headers, partition=ADMISSION_PARTITION)

    def _reconnect(self, error: Exception) -> None:
        log.warning("admission: %s; reconnecting", error)
        old, self._source = self._source, self._open()
        try:
            old.close()
        except Exception:
            pass


def fleet_admission(mode: str, *, max_staleness: int, groups_per_step: int, transport: Transport,
                    control_topic: str, experiences_topic: str, explorer_id: str,
                    heartbeat_s: float, counts_drops: bool = False,
                    async_max_staleness: int | None = None) -> StalenessAdmission:
    """`explorer.admission: staleness` for one explorer: the mode's admission bound (rft.modes; async:
    `async_max_staleness`), fed from Kafka when there is one; `counts_drops`: `explorer.admission_counts_drops`."""
    bound = admission_bound(mode, max_staleness, async_max_staleness)
    feed = None if bound is None else KafkaFleetFeed(
        transport, control_topic=control_topic, experiences_topic=experiences_topic,
        client_id=f"{explorer_id}-admission", live_horizon_s=3 * heartbeat_s, explorer_id=explorer_id)
    return StalenessAdmission(groups_per_step=groups_per_step, max_staleness=bound, feed=feed,
                              counts_drops=counts_drops)
