"""The trainer's experience feed: whole groups from the experiences topic, exactly once across restarts.

Contract:
- The feed reads the experiences topic without a consumer group, from offsets it is given (the trainer's
  checkpoint) or from the beginning. Per partition it takes records strictly in log order.
- Each record is either *taken* into a batch, or *skipped* with a counted reason: `dead_letter` (does not decode,
  or a claim-checked part of it cannot be fetched or verified, rft/transport/claims.py; the record goes to the
  dead-letter topic with the reason), `duplicate` (its group id was already taken: explorers deliver
  at-least-once), `stale` (the staleness tracker refuses it), `foreign` (another run's record), `untrainable`
  (decodes but cannot be trained on: empty, ids outside the vocabulary, over the length limits, a reward out of
  range; the trainer's `check`, rft.trainer.batch.TrainableLimits; the record goes to the dead-letter topic with
  the reason, so a resumed trainer never meets it again), `too_few_scored` (fewer than min(`min_scored`, its size)
  of its samples were scored: see below).
- Failed rollouts (a sample's `failure`, docs/schema.md "Failed rollouts") leave a group where the feed reads it,
  before the trainer's check, the operators, the policy and any algorithm see it: the group goes on with its scored
  samples only (its message re-encoded, so every rank, replay and baseline see the same), so every algorithm's
  baseline is over scored samples by construction and failed samples are never trained. The samples removed are
  counted per failure class in `Batch.failed` (records consumed while assembling the batch, taken or not).
- `FeedState` (offsets + the ids of the last MAX_TAKEN_IDS groups taken) describes exactly what has been consumed
  (a group id's length is bounded by the schema, rft.schema.MAX_ID_CHARS; a duplicate delivered more than
  MAX_TAKEN_IDS groups after its first is taken again). The trainer stores the
  state of step s in the checkpoint of step s; a trainer restarted from it sees every later record once and no
  earlier one. Records polled but not yet consumed are not part of the state.
- With a single-partition experiences topic (the default, `kafka.experience_partitions: 1`) the order of groups
  is the log order, so a restarted trainer assembles exactly the batches an uninterrupted one would have. With
  several partitions, the guarantee is the same set of groups, each once, in arrival order.
- Experience operators (`trainer.operators`, rft/experience/operators.py) run on each group the feed would take:
  one they drop is skipped as `dropped/<reason>`; one they change is taken changed (its message re-encoded, so every
  rank trains on the same). Their state is part of `FeedState`.
- A staleness policy (`trainer.staleness_policy`, rft/experience/staleness_policies.py) chooses: admitted groups
  enter a pool (`pool` groups, at least a step's), and each of a step's groups is the one the policy picks from
  it; a group the policy will not keep is skipped as `evicted`. Groups still in the pool after a step are *held*:
  consumed from the log (the offsets are past them), not taken, and checked again (the mode's bound, the policy) at
  each step. `FeedState.held` has their positions: a restarted feed re-reads them by offset, so the pool, and with
  one partition every later choice, is the uninterrupted feed's. The default, in_order with a pool of one step,
  takes groups as they arrive and never holds one.
Not thread-safe; one feed per trainer (global rank 0 reads, then broadcasts).
"""
from __future__ import annotations

import collections
import dataclasses
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from rft.experience.staleness_policies import InOrder, StalenessPolicy
from rft.schema import ExperienceGroup, RecordError, decode_group, encode
from rft.transport import (
    ClaimStore,
    DeadLetter,
    Message,
    RecordSink,
    RecordSource,
    Transport,
    TransportError,
    parse_positions,
    parse_time_ms,
    resolve_claims,
)

if TYPE_CHECKING:
    from rft.experience.operators import OperatorChain

log = logging.getLogger(__name__)


MAX_TAKEN_IDS = 65_536  # group ids a feed remembers (FeedState.taken_groups): duplicates are at-least-once redeliveries


class FeedTimeout(TimeoutError):
    pass


class EndOfReplay(Exception):
    """The replay window is exhausted; `batch` holds the groups taken since the last full batch."""

    def __init__(self, batch: Batch):
        super().__init__(f"replay window exhausted ({len(batch.groups)} groups in the last, partial batch)")
        self.batch = batch


@dataclass
class ReplayWindow:
    """A finite slice of a topic: offsets `[begin, stop)` per partition, and optionally only the records
    stamped in `[from_time_ms, to_time_ms)`. Resolved once when a replay starts and saved with the run, so
    that a resumed or repeated replay reads exactly the same records."""
    begin: dict[str, int]
    stop: dict[str, int]
    from_time_ms: int | None = None
    to_time_ms: int | None = None

    def to_json(self) -> dict:
        return {"begin": self.begin, "stop": self.stop, "from_time_ms": self.from_time_ms,
                "to_time_ms": self.to_time_ms}

    @classmethod
    def from_json(cls, data: dict) -> ReplayWindow:
        return cls(begin={k: int(v) for k, v in data["begin"].items()},
                   stop={k: int(v) for k, v in data["stop"].items()},
                   from_time_ms=data.get("from_time_ms"), to_time_ms=data.get("to_time_ms"))

    def contains_time(self, timestamp_ms: int) -> bool:
        return ((self.from_time_ms is None or timestamp_ms >= self.from_time_ms)
                and (self.to_time_ms is None or timestamp_ms < self.to_time_ms))


@dataclass
class FeedState:
    """What has been consumed: next offset per partition ("topic:partition") and the ids of the last MAX_TAKEN_IDS
    groups taken, oldest first (what a resumed feed needs to skip a duplicate delivery)."""
    offsets: dict[str, int] = field(default_factory=dict)
    taken_groups: list[str] = field(default_factory=list)
    operators: dict = field(default_factory=dict)  # the experience operators' state (OperatorChain.state)
    # groups consumed and held in the staleness policy's pool: {"position", "offset", "group_id"}, in the order read
    held: list[dict] = field(default_factory=list)

    def to_json(self) -> dict:
        return {"offsets": dict(self.offsets), "taken_groups": list(self.taken_groups),
                "operators": json.loads(json.dumps(self.operators)), "held": [dict(h) for h in self.held]}

    @classmethod
    def from_json(cls, data: dict) -> FeedState:
        return cls(offsets={str(k): int(v) for k, v in data.get("offsets", {}).items()},
                   taken_groups=[str(g) for g in data.get("taken_groups", [])][-MAX_TAKEN_IDS:],
                   operators=dict(data.get("operators", {})),
                   held=[{"position": str(h["position"]), "offset": int(h["offset"]), "group_id": str(h["group_id"])}
                         for h in data.get("held", [])])


@dataclass
class Batch:
    groups: list[ExperienceGroup]
    messages: list[Message]  # the records taken, in order (raw bytes, for broadcasting to other ranks)
    skipped: dict[str, int]  # reason -> count, for records consumed while assembling this batch
    # failure class -> failed samples removed from the groups read while assembling this batch (module docstring)
    failed: dict[str, int] = field(default_factory=collections.Counter)


# A decision on one decoded group: None to take it, or a skip reason.
Admit = Callable[[ExperienceGroup], str | None]


@dataclass
class _Held:
    """A group in the pool, the record it came from (as read: what a dead letter keeps) and that record with its
    claim-checked parts inline (what the batch carries to other ranks)."""
    message: Message
    inline: Message
    group: ExperienceGroup


class ExperienceFeed:
    def __init__(self, source: RecordSource, *, topic: str, run_id: str | None, dead_letter: DeadLetter,
                 state: FeedState | None = None, window: ReplayWindow | None = None,
                 reconnect: Callable[[], RecordSource] | None = None, operators: OperatorChain | None = None,
                 check: Callable[[ExperienceGroup], str | None] | None = None,
                 busy: Callable[[bool], None] | None = None, policy: StalenessPolicy | None = None,
                 pool: int = 0, claims: ClaimStore | None = None, min_scored: int = 2):
        """`run_id=None` accepts records of any run (replaying another run's topic). `reconnect` makes a new
        source when the current one fails (TransportError); the feed re-seeks it to its own state. `check(group)`:
        None when a decoded group can be trained on, else the reason; such a group is dead-lettered with
        `cannot be trained: <reason>` and skipped as `untrainable` (consumed like any record). `busy(flag)`: told
        False while `next_batch` waits for records and True once it has its batch (or the replay ended): the
        trainer's mark on a core board (rft/cores.py `CoreShare.set_busy`). `policy` (default in_order) picks each
        group from a pool of max(`pool`, the batch's groups) (the module docstring). `claims`: the store
        claim-checked parts are resolved from; a taken record's message holds them inline (other ranks need no
        store). `min_scored`: a group with failed samples needs min(`min_scored`, its size) scored ones (module
        docstring; trainer.min_scored_samples)."""
        if min_scored < 1:
            raise ValueError(f"min_scored must be >= 1, got {min_scored}")
        self.min_scored = min_scored
        self.reconnect, self.check, self.busy, self.claims = reconnect, check, busy, claims
        self.operators = operators
        self.source, self.topic, self.run_id, self.dead_letter = source, topic, run_id, dead_letter
        self.window = window
        self.state = state or FeedState()
        if operators is not None:
            operators.load_state(self.state.operators)
        if window is not None and not self.state.offsets:  # a replay's first start (a resume has offsets)
            self.state.offsets = dict(window.begin)
        self._taken = set(self.state.taken_groups)
        self._buffer: collections.deque[Message] = collections.deque()
        self.policy: StalenessPolicy = policy or InOrder()
        self.pool_size = pool
        self._pool: list[_Held] = [h for h in map(self._reread, self.state.held) if h is not None]
        self.lost_held = len(self.state.held) - len(self._pool)  # held records no longer on the topic
        partitions = source.assign([topic])
        starts = source.beginning_offsets(topic)
        for key in partitions:
            self.state.offsets.setdefault(key, starts[key])
        source.seek(self.state.offsets)

    def next_batch(self, n_groups: int, *, admit: Admit = lambda g: None, version: int = 0,
                   timeout_s: float = 600.0, on_wait: Callable[[int], None] | None = None) -> Batch:
        """Consume records until `n_groups` groups are taken, each picked by the policy from a pool of
        max(pool, n_groups) for the trainer's `version` (held groups first checked again with `admit` and the policy).
        Raises FeedTimeout if no record arrives for `timeout_s` (what was consumed so far stays consumed and is in
        `state`). `on_wait(n)` while starved: n = groups taken into this batch plus those held."""
        batch = Batch(groups=[], messages=[], skipped=collections.Counter(), failed=collections.Counter())
        pool_size = max(self.pool_size, n_groups)
        self._recheck(admit, version, batch)
        last_record = time.monotonic()
        while len(batch.groups) < n_groups:
            if len(self._pool) < pool_size - len(batch.groups) and (self._buffer or not self._window_done()):
                if not self._buffer:
                    self._buffer.extend(self._poll())
                    if not self._buffer:
                        if time.monotonic() - last_record > timeout_s:
                            raise FeedTimeout(f"no experience arrived on {self.topic!r} for {timeout_s:.0f} s "
                                              f"({len(batch.groups)}/{n_groups} groups of this batch taken, "
                                              f"{len(self._pool)} read into the pool)")
                        self._mark_busy(False)
                        if on_wait:
                            on_wait(len(batch.groups) + len(self._pool))
                        continue
                last_record = time.monotonic()
                reason = self._consume(self._buffer.popleft(), admit, version, batch)
            elif not self._pool:  # a replay window exhausted
                self._mark_busy(True)
                raise EndOfReplay(batch)
            else:
                reason = self._take(self._pick(version), batch)
            if reason:
                batch.skipped[reason] += 1
        self._mark_busy(True)
        return batch

    @property
    def held(self) -> int:
        """Groups consumed and held in the pool, not taken yet."""
        return len(self._pool)

    def _mark_busy(self, busy: bool) -> None:
        if self.busy is not None:
            self.busy(busy)

    def _poll(self) -> list[Message]:
        try:
            messages = self.source.poll(timeout_s=0.5)
        except TransportError as e:
            if self.reconnect is None:
                raise
            log.warning("experience feed: %s; reconnecting at %s", e, self.state.offsets)
            self._reopen(self.reconnect)
            return []
        if self.window is not None:  # records at or past a partition's stop are never consumed
            messages = [m for m in messages if m.offset < self.window.stop.get(m.position, 0)]
        return messages

    def _reopen(self, reconnect: Callable[[], RecordSource]) -> None:
        """A fresh source positioned at what has been consumed (records polled but not consumed are
        dropped from the buffer and read again)."""
        old, self.source = self.source, reconnect()
        self._buffer.clear()
        self.source.assign([self.topic])
        self.source.seek(self.state.offsets)
        try:
            old.close()
        except Exception as e:  # the wedged client may not close cleanly; it is abandoned either way
            log.warning("closing the old experience source failed: %s", e)

    def _window_done(self) -> bool:
        return self.window is not None and all(
            self.state.offsets.get(k, 0) >= stop for k, stop in self.window.stop.items())

    def _consume(self, message: Message, admit: Admit, version: int, batch: Batch) -> str | None:
        """Read one record into the pool, or the reason it is skipped (failed samples counted in `batch.failed`)."""
        if message.offset < self.state.offsets.get(message.position, 0):
            return "already_consumed"  # a client that rewound (it should not): never consume twice
        self.state.offsets[message.position] = message.offset + 1
        if self.window is not None and not self.window.contains_time(message.timestamp_ms):
            return "out_of_window"
        try:
            inline = resolve_claims(message, self.claims)
            group = decode_group(inline.value, inline.headers)
        except RecordError as e:
            self.dead_letter.divert(message, str(e))
            return "dead_letter"
        if self.run_id is not None and group.run_id != self.run_id:
            self.dead_letter.divert(message, f"foreign record: run {group.run_id!r}, this run is {self.run_id!r}")
            return "foreign"
        if group.group_id in self._taken or any(h.group.group_id == group.group_id for h in self._pool):
            return "duplicate"
        batch.failed.update(collections.Counter(s.failure for s in group.samples if s.failure))
        scored = self._scored(group, inline)
        if scored is None:
            return "too_few_scored"
        group, inline = scored
        if self.check is not None and (problem := self.check(group)):
            self.dead_letter.divert(message, f"cannot be trained: {problem}")
            return "untrainable"
        reason = self._refusal(group, admit, version)
        if reason:
            return reason
        self._pool.append(_Held(message, inline, group))
        return None

    def _scored(self, group: ExperienceGroup, inline: Message) -> tuple[ExperienceGroup, Message] | None:
        """`group` and its record without their failed samples (unchanged when none failed), or None when fewer than
        min(min_scored, its size) are left (the module docstring)."""
        scored = group.scored_samples
        if len(scored) == len(group.samples):
            return group, inline
        if len(scored) < min(self.min_scored, len(group.samples)):
            return None
        group = dataclasses.replace(group, samples=scored)
        return group, dataclasses.replace(inline, value=encode(group)[0])

    def _refusal(self, group: ExperienceGroup, admit: Admit, version: int) -> str | None:
        """Why `group` may not be taken at `version` (the trainer's `admit`, then the policy), or None."""
        return admit(group) or (None if self.policy.keep(group, version=version) else "evicted")

    def _recheck(self, admit: Admit, version: int, batch: Batch) -> None:
        """Held groups, checked again for this step: those refused now leave the pool, counted."""
        kept = []
        for held in self._pool:
            reason = self._refusal(held.group, admit, version)
            if reason:
                batch.skipped[reason] += 1
            else:
                kept.append(held)
        self._pool = kept

    def _pick(self, version: int) -> _Held:
        index = self.policy.pick([h.group for h in self._pool], version=version)
        if not isinstance(index, int) or not 0 <= index < len(self._pool):
            raise ValueError(f"trainer.staleness_policy {type(self.policy).__name__}.pick returned {index!r}, not an "
                             f"index of the pool of {len(self._pool)}")
        return self._pool.pop(index)

    def _take(self, held: _Held, batch: Batch) -> str | None:
        """Take a picked group into `batch` (through the operators), or the reason it is skipped."""
        group, message, inline = held.group, held.message, held.inline
        if self.operators is not None:
            shaped, reason = self.operators.apply(group)
            if reason:
                return reason
            if shaped is not group:
                if self.check is not None and (problem := self.check(shaped)):  # e.g. a reward shaped out of range
                    self.dead_letter.divert(message, f"cannot be trained after trainer.operators: {problem}")
                    return "untrainable"
                group, inline = shaped, dataclasses.replace(inline, value=encode(shaped)[0])
        self._taken.add(group.group_id)
        taken = self.state.taken_groups
        taken.append(group.group_id)
        if len(taken) > MAX_TAKEN_IDS:  # the oldest leaves (ids are unique in it: a duplicate is never taken)
            self._taken.discard(taken.pop(0))
        batch.groups.append(group)
        batch.messages.append(inline)  # claims resolved: what other ranks decode (a dead letter keeps them)
        return None

    def _reread(self, held: dict) -> _Held | None:
        """A held group of a saved state, re-read from the topic by offset (None, logged, when it is gone)."""
        message = self.source.fetch(held["position"], held["offset"])
        group = inline = None
        if message is not None:
            try:
                inline = resolve_claims(message, self.claims)
                group = decode_group(inline.value, inline.headers)
            except RecordError:
                group = None
        scored = None if message is None or inline is None or group is None else self._scored(group, inline)
        if message is None or scored is None or scored[0].group_id != held["group_id"]:
            log.warning("experience feed: held group %s at %s@%d is no longer on the topic (or its claims are gone)",
                        held["group_id"], held["position"], held["offset"])
            return None
        return _Held(message, scored[1], scored[0])  # as it was held: its failed samples removed

    def snapshot(self) -> FeedState:
        if self.operators is not None:
            self.state.operators = self.operators.state()
        self.state.held = [{"position": h.message.position, "offset": h.message.offset, "group_id": h.group.group_id}
                           for h in self._pool]
        return FeedState.from_json(self.state.to_json())


def open_feed(transport: Transport, *, topic: str, dead_letter_topic: str,
              run_id: str | None, state: FeedState | None = None, window: ReplayWindow | None = None,
              client_id: str = "rft-trainer", operators: OperatorChain | None = None,
              check: Callable[[ExperienceGroup], str | None] | None = None,
              busy: Callable[[bool], None] | None = None, policy: StalenessPolicy | None = None,
              pool: int = 0, min_scored: int = 2) -> tuple[ExperienceFeed, RecordSink, RecordSource]:
    """Build a feed with its own source and dead-letter sink from `transport` (resolving claims from its claim store);
    the caller closes both. `check`, `busy`, `policy`, `pool`, `min_scored`: as ExperienceFeed's."""

    def new_source() -> RecordSource:
        return transport.source(client_id=client_id)

    source = new_source()
    sink = transport.sink(client_id=f"{client_id}-dlq")
    feed = ExperienceFeed(source, topic=topic, run_id=run_id, dead_letter=DeadLetter(sink, dead_letter_topic),
                          state=state, window=window, reconnect=new_source, operators=operators, check=check,
                          busy=busy, policy=policy, pool=pool, claims=transport.claims, min_scored=min_scored)
    return feed, sink, source


def resolve_window(source: RecordSource, topic: str, *, start: str = "", end: str = "") -> ReplayWindow:
    """A replay window from the `replay.start` / `replay.end` specs: `P:O[,P:O...]` offsets, a time (ISO 8601
    or milliseconds since the epoch), or empty for the topic's beginning / its end as of now."""
    partitions = len(source.partitions(topic))

    def parse(spec: str, option: str) -> tuple[dict[str, int] | None, int | None]:
        if not spec:
            return None, None
        if ":" in spec and not any(c in spec for c in "-T"):
            return parse_positions(spec.split(","), topic, option, partitions), None
        return None, parse_time_ms(spec, option)

    start_offsets, from_ms = parse(start, "replay.start")
    end_offsets, to_ms = parse(end, "replay.end")
    begin, stop = source.replay_bounds(topic, start=start_offsets, end=end_offsets, from_time_ms=from_ms)
    return ReplayWindow(begin=begin, stop=stop, from_time_ms=from_ms, to_time_ms=to_ms)
