"""What `rft serve` knows of its completions, to refuse bad feedback before it is recorded (`FeedbackLedger`).

The topics are the source of truth: a server (re)starting reads `<prefix>.served` and `<prefix>.feedback` back over
the last `2 x serve.feedback_expire_s` (`load`), so a served completion and its feedback survive a restart of the
server. Then it adds what it serves and accepts. Feedback is refused (`FeedbackRefused`, with the HTTP status and an
OpenAI-style error code) for an id it never served or forgot (404 `unknown_id`), a choice index the request did not
have (400 `invalid_index`), a completion served more than `feedback_expire_s` ago (410 `expired`), and a choice
already rewarded (409 `already_rewarded`). With several servers behind one joiner the joiner is the authority (it
keeps the first reward of a choice); each server refuses what it has seen. Thread-safe.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from rft.schema import Feedback, RecordError, ServedCompletion, decode
from rft.transport import ClaimStore, resolve_claims


class FeedbackRefused(ValueError):
    """Feedback that changes nothing: `status` (HTTP), `code` (OpenAI-style error code) and the message."""

    def __init__(self, status: int, code: str, message: str):
        super().__init__(message)
        self.status, self.code = status, code


@dataclass
class _Entry:
    served_at: float
    n: int
    rewarded: set[int] = field(default_factory=set)


class FeedbackLedger:
    def __init__(self, expire_s: float, *, clock=time.time):
        self.expire_s, self.clock = expire_s, clock
        self._entries: dict[str, _Entry] = {}
        self._lock = threading.Lock()
        self._pruned_at = 0.0

    def served(self, request_id: str, n: int, served_at: float) -> None:
        with self._lock:
            self._entries.setdefault(request_id, _Entry(served_at, n))

    def reserve(self, items: list[tuple[str, int]]) -> None:
        """Check feedback for `(request id, index)` items and mark them rewarded, all or none: FeedbackRefused
        naming the first bad one (nothing marked). `release` undoes it when recording fails."""
        now = self.clock()
        with self._lock:
            self._prune(now)
            seen: set[tuple[str, int]] = set()
            for rid, index in items:
                entry = self._entries.get(rid)
                if entry is None:
                    raise FeedbackRefused(404, "unknown_id", f"no completion with id {rid!r} was served by this run "
                                          f"(or it was served more than {2 * self.expire_s:.0f} s ago)")
                if not 0 <= index < entry.n:
                    raise FeedbackRefused(400, "invalid_index", f"completion {rid!r} has choices 0..{entry.n - 1}; "
                                          f"got index {index}")
                if now - entry.served_at > self.expire_s:
                    raise FeedbackRefused(410, "expired", f"completion {rid!r} was served {now - entry.served_at:.0f}"
                                          f" s ago; feedback is taken for serve.feedback_expire_s = "
                                          f"{self.expire_s:.0f} s")
                if index in entry.rewarded or (rid, index) in seen:
                    raise FeedbackRefused(409, "already_rewarded", f"choice {index} of completion {rid!r} already "
                                          "has its reward")
                seen.add((rid, index))
            for rid, index in items:
                self._entries[rid].rewarded.add(index)

    def release(self, items: list[tuple[str, int]]) -> None:
        with self._lock:
            for rid, index in items:
                entry = self._entries.get(rid)
                if entry is not None:
                    entry.rewarded.discard(index)

    def _prune(self, now: float) -> None:
        if now - self._pruned_at < 60:
            return
        self._pruned_at = now
        for rid in [r for r, e in self._entries.items() if now - e.served_at > 2 * self.expire_s]:
            del self._entries[rid]

    def __len__(self) -> int:
        return len(self._entries)

    def load(self, source, served_topic: str, feedback_topic: str, *, claims: ClaimStore | None = None) -> int:
        """Read back the served and feedback records of the last 2 x expire_s (a source without a group; claims
        resolved from `claims`); returns the number of records applied. Records that do not decode are skipped (the
        joiner dead-letters them)."""
        since = int((self.clock() - 2 * self.expire_s) * 1000)
        applied = 0
        for topic in (served_topic, feedback_topic):  # served first: feedback needs its entry
            for m in source.read_range(topic, from_time_ms=since, idle_timeout_s=5.0):
                try:
                    inline = resolve_claims(m, claims)
                    record = decode(inline.value, inline.headers)
                except RecordError:
                    continue
                if isinstance(record, ServedCompletion):
                    self.served(record.request_id, len(record.choices), record.created_at)
                elif isinstance(record, Feedback):
                    with self._lock:
                        entry = self._entries.get(record.request_id)
                        if entry is not None:
                            entry.rewarded.add(record.index)
                else:
                    continue
                applied += 1
        return applied
