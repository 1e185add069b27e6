"""Collecting claim-checked parts (rft/transport/claims.py): the two modes of `records.collect`, over a claim store
and a topic source. Who decides what has been passed, and when to run, is the caller's (rft/trainer/collect.py).

- `collect_retention(store, retention_s=)`: every object last written more than `retention_s` ago is deleted (a
  re-put of the same payload, by any record, refreshes it). Nothing else is read.
- `collect_committed(store, source, topic, passed=, start=)`: the candidates are the claims of the records of
  `topic` in `[start, passed)` per partition (`passed`: the lowest next offset every reader that must read them has
  committed). A candidate is deleted unless one of these keeps it:
    1. a record of `topic` in `[passed, end)`, read now (the tail no reader has passed), or of a `protect` topic,
       names it;
    2. its object was written after the newest record of the window that names it (a later record re-put it);
    3. its object was written less than `recent_s` before this collection began (a record that stored it may not
       be on the topic yet: a producer sets a record's timestamp right after the put, and delivers it within its
       request timeout); the records of the window that name it are read again by the next collection.
  The one window left: a record that stored its part more than `recent_s` before it reached the topic, reached it
  after rule 1's read, and shares that part with a record of the window; its group is dead-lettered "missing"
  (never trained wrong). Rules 2 and 3 compare the store's clock with the producers' (`timestamp_ms`).
  A read that does not complete (TransportError) deletes nothing. The report's `collected_to` is where the next
  collection starts.
`dry_run` deletes nothing and reports what would go."""
from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime

from rft.schema import RecordError
from rft.transport.base import RecordSource
from rft.transport.claims import ClaimStore, claims_in

log = logging.getLogger(__name__)

RECENT_S = 600.0  # rule 3 of the module docstring


@dataclass
class CollectReport:
    """What a collection did (or, dry, would do)."""
    mode: str
    dry_run: bool
    deleted: list[str] = field(default_factory=list)  # sha256 of the objects deleted
    bytes_freed: int = 0  # stored bytes of those objects (retention: known; committed: their payload sizes)
    kept: dict[str, int] = field(default_factory=dict)  # reason -> candidates kept
    records: int = 0  # committed: records read in the window
    collected_to: dict[str, int] = field(default_factory=dict)  # committed: where the next collection starts

    def summary(self) -> str:
        verb = "would delete" if self.dry_run else "deleted"
        kept = ", ".join(f"{n} {reason}" for reason, n in sorted(self.kept.items())) or "none"
        window = f"{self.records} records read, " if self.mode == "committed" else ""
        return (f"records.collect {self.mode}: {window}{verb} {len(self.deleted)} objects "
                f"({self.bytes_freed / 1e6:.1f} MB); kept: {kept}")


def _ms(moment: datetime) -> int:
    return int(moment.timestamp() * 1000)


def collect_retention(store: ClaimStore, *, retention_s: float, now_s: float | None = None,
                      dry_run: bool = False) -> CollectReport:
    """Delete every object of `store` last written more than `retention_s` before `now_s` (default: now)."""
    report = CollectReport("retention", dry_run)
    cutoff_ms = int(((time.time() if now_s is None else now_s) - retention_s) * 1000)
    for meta in store.list():
        if _ms(meta["last_modified"]) >= cutoff_ms:
            report.kept["younger than the retention"] = report.kept.get("younger than the retention", 0) + 1
            continue
        if not dry_run:
            store.delete(meta["sha256"])
        report.deleted.append(meta["sha256"])
        report.bytes_freed += meta["size"]
    return report


@dataclass
class _Named:
    """A payload as the records of a window name it: the newest record's timestamp, its size, and the first offset
    per partition of a record naming it."""
    newest_ms: int
    size: int
    first: dict[str, int] = field(default_factory=dict)


def _claims(messages: Iterable, into: dict[str, _Named]) -> int:
    """Note each record's claims in `into` (by sha256); the number of records read. A record whose claims are
    malformed names nothing this can trust: it is skipped (its reader dead-letters it)."""
    n = 0
    for m in messages:
        n += 1
        try:
            found = claims_in(m.value or b"")
        except RecordError as e:
            log.warning("collect: %s@%d has malformed claims (%s); skipped", m.position, m.offset, e)
            continue
        for claim in found:
            named = into.setdefault(claim.sha256, _Named(m.timestamp_ms, claim.size))
            named.newest_ms = max(named.newest_ms, m.timestamp_ms)
            named.first.setdefault(m.position, m.offset)
    return n


def collect_committed(store: ClaimStore, source: RecordSource, topic: str, *, passed: dict[str, int],
                      start: dict[str, int], protect: Iterable[str] = (), recent_s: float = RECENT_S,
                      now_s: float | None = None, idle_timeout_s: float = 10.0,
                      dry_run: bool = False) -> CollectReport:
    """The `committed` mode of the module docstring. `source`: without a group. `passed` / `start`: next offsets
    per "topic:partition" of `topic` (a partition missing from `passed` has passed nothing)."""
    report = CollectReport("committed", dry_run)
    began_ms = int((time.time() if now_s is None else now_s) * 1000)
    first = source.beginning_offsets(topic)
    end = source.end_offsets(topic)
    begin = {p: max(start.get(p, 0), first[p]) for p in end}
    stop = {p: min(max(passed.get(p, 0), begin[p]), end[p]) for p in end}
    window: dict[str, _Named] = {}
    report.records = _claims(source.read_offsets(begin, stop, idle_timeout_s=idle_timeout_s), window)
    report.collected_to = dict(stop)
    if not window:
        return report
    referenced: dict[str, _Named] = {}
    _claims(source.read_offsets(stop, end, idle_timeout_s=idle_timeout_s), referenced)
    for other in protect:
        lo, hi = source.beginning_offsets(other), source.end_offsets(other)
        _claims(source.read_offsets(lo, hi, idle_timeout_s=idle_timeout_s), referenced)

    def keep(reason: str) -> None:
        report.kept[reason] = report.kept.get(reason, 0) + 1

    for sha, named in window.items():
        if sha in referenced:
            keep("named by a record not passed")  # a candidate again once that record is passed
            continue
        written = store.last_modified(sha)
        if written is None:
            keep("already gone")
        elif _ms(written) > named.newest_ms:
            keep("written again since")  # by a record after the window: a candidate again with it
        elif _ms(written) > began_ms - recent_s * 1000:
            keep("written recently")  # nothing later need name it: the next collection reads its records again
            for position, offset in named.first.items():
                report.collected_to[position] = min(report.collected_to[position], offset)
        else:
            if not dry_run:
                store.delete(sha)
            report.deleted.append(sha)
            report.bytes_freed += named.size
    return report
