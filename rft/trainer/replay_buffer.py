"""Prioritised replay from the experiences topic: besides its fresh groups, each step re-trains on a few earlier
groups, chosen by priority and re-read from the topic by offset. `ReplayBuffer` holds metadata only, one `Candidate`
per group that may be replayed (where its record is, its group id, score, first step and reuse count), never the
records: `ExperienceReplay` re-reads a chosen group with `RecordSource.fetch`.

Per step s, with R = `replay_buffer.groups_per_step`, M = `max_reuse`, d = `decay` (rank 0, before the feed):
  1. choose min(R, size) candidates, without replacement, with probability proportional to
         priority = score x d^(s - first_step)
     by weighted sampling seeded with (seed, s): a pure function of (candidates, s, seed), no RNG state to save;
  2. re-read them from the topic; each one's reuse count goes up by one; a candidate that reached M leaves;
  3. the step's fresh groups become candidates with reuse 0 and their score (`replay_buffer.priority`; a group
     scored 0 is never chosen and not kept); beyond `capacity` the oldest candidates are forgotten.
So a group trains at most 1 + M times, never replayed in its own step. The buffer's state after step s is
checkpointed with the feed's offsets: a restarted trainer trains on the same (group, reuse) pairs as one that never
stopped. A replayed group is never dropped for staleness and is counted apart (`replay_staleness_*`); the importance
correction is the algorithm's (`algorithm.off_policy_correction`). A group gone from the topic leaves the buffer and
is counted (`replay_missing`), as is one whose claim-checked parts cannot be fetched and verified (collected; a
re-read group holds them inline, rft/transport/claims.py). Not thread-safe; rank 0 only.
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

import numpy as np

from rft.experience.priorities import Score, resolve_priority
from rft.modes import staleness
from rft.schema import ExperienceGroup, RecordError, decode_group
from rft.transport import TransportError, resolve_claims

if TYPE_CHECKING:
    from rft.trainer.config import ReplayBufferConfig
    from rft.transport import ClaimStore, Message, RecordSource

log = logging.getLogger(__name__)

@dataclass
class Candidate:
    position: str  # "topic:partition"
    offset: int
    group_id: str
    score: float
    step: int  # the step that trained the group fresh
    reuse: int = 0  # times replayed so far


class ReplayBuffer:
    """Candidates in insertion order (that order, with the seed, makes the choice reproducible)."""

    def __init__(self, *, max_reuse: int, decay: float, capacity: int, seed: int):
        self.max_reuse, self.decay, self.capacity, self.seed = max_reuse, decay, capacity, seed
        self.candidates: list[Candidate] = []

    def __len__(self) -> int:
        return len(self.candidates)

    def priorities(self, step: int) -> np.ndarray:
        scores = np.array([c.score for c in self.candidates], dtype=np.float64)
        ages = np.array([step - c.step for c in self.candidates], dtype=np.float64)
        return scores * self.decay ** ages

    def choose(self, n: int, step: int) -> list[Candidate]:
        """Up to `n` distinct candidates for `step`, in draw order; pure (the buffer is not changed). Efraimidis-
        Spirakis keys: log(u) / priority, the largest win; the consumed.jsonl record of each group says its `reuse`
        (0 = fresh)."""
        weights = self.priorities(step)
        eligible = np.flatnonzero(weights > 0)
        if n <= 0 or not len(eligible):
            return []
        rng = np.random.default_rng([self.seed % (1 << 63), step])
        uniforms = 1.0 - rng.random(len(self.candidates))  # in (0, 1]: log is finite
        keys = np.log(uniforms[eligible]) / weights[eligible]
        order = sorted(range(len(eligible)), key=lambda i: (-keys[i], eligible[i]))
        return [self.candidates[eligible[i]] for i in order[:n]]

    def mark_replayed(self, chosen: list[Candidate]) -> None:
        for c in chosen:
            c.reuse += 1
        self.candidates = [c for c in self.candidates if c.reuse < self.max_reuse]

    def forget(self, gone: list[Candidate]) -> None:
        ids = {id(c) for c in gone}
        self.candidates = [c for c in self.candidates if id(c) not in ids]

    def add(self, fresh: list[Candidate]) -> None:
        self.candidates.extend(c for c in fresh if c.score > 0)
        del self.candidates[:max(0, len(self.candidates) - self.capacity)]

    def to_json(self) -> dict:
        return {"candidates": [asdict(c) for c in self.candidates]}

    def load_json(self, data: dict) -> None:
        self.candidates = [Candidate(**c) for c in data.get("candidates", [])]


@dataclass
class Replayed:
    message: Message
    group: ExperienceGroup
    reuse: int  # 1 = its first replay


class ExperienceReplay:
    """The trainer's side: choose, re-read and remember groups (see the module docstring for the order)."""

    def __init__(self, buffer: ReplayBuffer, *, groups_per_step: int, score: Score, reader: RecordReader):
        self.buffer, self.groups_per_step, self.score, self.reader = buffer, groups_per_step, score, reader
        self.missing = 0

    def replay(self, step: int) -> list[Replayed]:
        """This step's replayed groups, re-read from the topic (steps 1 and 2)."""
        chosen = self.buffer.choose(self.groups_per_step, step)
        found, gone = [], []
        for candidate in chosen:
            message = self.reader.fetch(candidate.position, candidate.offset)
            message, group = _decode_if(message, candidate.group_id, self.reader.claims) if message is not None \
                else (None, None)
            if message is None or group is None:
                log.warning("replay: %s@%d (group %s) is no longer on the topic", candidate.position,
                            candidate.offset, candidate.group_id)
                gone.append(candidate)
                continue
            found.append(Replayed(message, group, candidate.reuse + 1))
        self.missing += len(gone)
        self.buffer.forget(gone)
        self.buffer.mark_replayed([c for c in chosen if all(c is not g for g in gone)])
        return found

    def remember(self, step: int, messages: list[Message], groups: list[ExperienceGroup]) -> None:
        """The step's fresh groups become candidates (step 3)."""
        self.buffer.add([Candidate(m.position, m.offset, g.group_id, self._score(g), step)
                         for m, g in zip(messages, groups, strict=True)])

    def _score(self, group: ExperienceGroup) -> float:
        score = float(self.score(group))
        if not np.isfinite(score) or score < 0:
            raise ValueError(f"replay_buffer.priority gave {score} for group {group.group_id}: scores must be "
                             "finite and >= 0")
        return score

    def step_metrics(self, step: int, replayed: list[Replayed]) -> dict:
        """The step's replay metrics (staleness over the replayed samples; `replay_missing`: candidates found gone
        since the last call)."""
        samples = [(staleness(step, r.group.policy_version), len(r.group.samples)) for r in replayed]
        n = sum(count for _, count in samples)
        missing, self.missing = self.missing, 0
        return {"replay_groups": len(replayed), "replay_buffer_size": len(self.buffer), "replay_missing": missing,
                "replay_staleness_mean": sum(s * count for s, count in samples) / n if n else 0.0,
                "replay_staleness_max": max((s for s, _ in samples), default=0)}


def _decode_if(message: Message, group_id: str, claims: ClaimStore | None
               ) -> tuple[Message, ExperienceGroup] | tuple[None, None]:
    """`message` with its claims resolved and its group, if that is the one expected there (a recreated topic holds
    others); (None, None) otherwise."""
    try:
        inline = resolve_claims(message, claims)
        group = decode_group(inline.value, inline.headers)
    except RecordError as e:
        log.warning("replay: %s@%d does not decode: %s", message.position, message.offset, e)
        return None, None
    return (inline, group) if group.group_id == group_id else (None, None)


def open_replay(section: ReplayBufferConfig, *, run_seed: int, topic_source: Callable[[], RecordSource],
                state: dict | None, claims: ClaimStore | None = None) -> ExperienceReplay:
    """The trainer's ExperienceReplay from the `replay_buffer` section (its seed defaults to `run_seed`), reading
    through sources made by `topic_source` (a fresh one after a TransportError), resolving claims from `claims`, and
    restored from a checkpoint's `state`; the caller closes its `reader`."""
    buffer = ReplayBuffer(max_reuse=section.max_reuse, decay=section.decay, capacity=section.capacity,
                          seed=run_seed if section.seed is None else section.seed)
    buffer.load_json(state or {})
    return ExperienceReplay(buffer, groups_per_step=section.groups_per_step,
                            score=resolve_priority(section.priority), reader=RecordReader(topic_source, claims))


class RecordReader:
    """Seek + fetch through its own RecordSource (the feed's keeps its position); one retry on a new source. `claims`:
    the store the groups' claim-checked parts are resolved from."""

    def __init__(self, new_source: Callable[[], RecordSource], claims: ClaimStore | None = None):
        self.new_source, self.claims = new_source, claims
        self.source: RecordSource | None = None

    def fetch(self, position: str, offset: int) -> Message | None:
        for attempt in (1, 2):
            if self.source is None:
                self.source = self.new_source()
            try:
                return self.source.fetch(position, offset)
            except TransportError as e:
                log.warning("replay: fetching %s@%d: %s; reconnecting", position, offset, e)
                self.close()
                if attempt == 2:
                    raise
        raise AssertionError("unreachable: the second attempt returns or raises")

    def close(self) -> None:
        if self.source is not None:
            try:
                self.source.close()
            except Exception as e:  # a wedged client may not close cleanly; it is abandoned either way
                log.warning("closing the replay source failed: %s", e)
            self.source = None
