"""A task's way through an explorer, the same for the batch loop (rft/explorer/batch.py) and the continuous loop
(rft/explorer/continuous.py): in through `TaskIntake`, out through `Delivery`, with `Offsets` saying how far each
tasks partition may be committed.

  intake    poll the tasks consumer group; keep what admission lets start and give the rest back (seek) for a later
            poll; decode (malformed or foreign records, tasks whose images are over the run's limits, and tasks
            with images for a workflow that takes none, go to the dead-letter topic with the reason); every admitted
            task's offset is opened in `Offsets`, a dead-lettered one is done at once.
  delivery  produce one ExperienceGroup per explored task to the experiences topic (key = group id; a task that
            cannot be explored, whose group holds a reward (its greedy_reward too) outside the run's range, whose
            group is over the record limit, or whose claim-checked parts the claim store would not take past its
            retries, goes to the dead-letter topic), flush, wait
            for every acknowledgement, and only then mark those tasks done in `Offsets` and commit what it allows.
            Samples whose rollout failed outside the policy (`Sample.failure`) are counted per class
            (`stats.failed`) and sent in their group, a group whose every sample failed too: the trainer leaves
            them out of the baseline and drops a group left with too few scored samples, counting both
            (rft/trainer/feed.py), so one count of what reached training lives in one place.

Delivery is at-least-once: a failed acknowledgement raises before anything is committed, and a crash between the
acks and the commit re-delivers the tasks to some explorer, which produces groups with the same group id
(`schema.group_id_for(run, task, epoch)`) and a different `(explorer_id, attempt)`; the trainer drops the duplicates.
A commit the broker refuses (a rebalance took the partitions) is logged and the tasks are explored again elsewhere.
"""
from __future__ import annotations

import collections
import dataclasses
import logging
import time
from typing import TYPE_CHECKING

from rft.schema import ExperienceGroup, decode_task
from rft.transport import ClaimStoreUnavailable, RecordTooLarge, parse_offset_key

if TYPE_CHECKING:
    from rft.explorer.admission import Admission
    from rft.explorer.membership import Membership
    from rft.explorer.stats import ExplorerStats
    from rft.schema import ImageLimits, RewardRange, TaskRecord
    from rft.transport import DeadLetter, Message, RecordSink, SendFuture
    from rft.transport.run_topics import RunTopics
    from rft.workflows import GroupResult

log = logging.getLogger("rft.explorer")

POLL_S = 0.5  # longest wait for tasks in one poll
ADMISSION_WAIT_S = 2.0  # longest wait for news when admission lets nothing start (it wakes on a control message)


class IdleClock:
    """`exit_when_idle_s` for both loops: `expired()` once `limit_s` seconds passed since the last `work()` (None:
    never). The clock starts once the tasks consumer has its group's first answer to its join (`RecordSource.joined`):
    before it the explorer cannot tell whether tasks are waiting for it (seen: an explorer that took Tansu's JoinGroup
    for an idle window and left with every task unexplored). Later rebalances do not stop it: a group wedged by a
    leaving member would hold the explorer for ever where `rft run`'s explore mode needs it to end."""

    def __init__(self, membership: Membership, limit_s: float | None):
        self.membership, self.limit_s = membership, limit_s
        self._last = time.monotonic()

    def work(self) -> None:
        self._last = time.monotonic()

    def expired(self) -> bool:
        if self.limit_s is None:
            return False
        tasks = self.membership.tasks
        if tasks is None or not tasks.joined:
            self.work()
            return False
        return time.monotonic() - self._last > self.limit_s


class Offsets:
    """Task offsets in flight per partition (`position` = "topic:partition"); `committable()` gives, per partition
    with news, the offset to commit: one past the highest done offset, but never past the lowest unfinished one, so a
    task is committed only once its group (and every earlier task's) is on the broker. The batch loop opens one per
    batch (all its tasks are done together); the continuous loop keeps one while it holds its consumer group."""

    def __init__(self) -> None:
        self._open: dict[str, set[int]] = {}
        self._done: dict[str, int] = {}  # one past the highest done offset
        self._committed: dict[str, int] = {}  # the last offset committed (or, before any, the first started)

    def start(self, position: str, offset: int) -> None:
        self._open.setdefault(position, set()).add(offset)
        self._committed.setdefault(position, offset)

    def done(self, position: str, offset: int) -> None:
        still = self._open.get(position)
        if still is None:  # forgotten (rebalance): nothing to commit for it here
            return
        still.discard(offset)
        self._done[position] = max(self._done.get(position, 0), offset + 1)

    def unfinished(self) -> int:
        return sum(len(v) for v in self._open.values())

    def committable(self) -> dict[str, int]:
        out = {}
        for position, done in self._done.items():
            still = self._open.get(position)
            offset = min(min(still), done) if still else done
            if offset > self._committed[position]:
                out[position] = offset
        return out

    def committed(self, offsets: dict[str, int]) -> None:
        self._committed.update(offsets)

    def forget(self, positions: set[str]) -> None:
        """Partitions no longer held (a rebalance): their tasks are re-delivered to whoever holds them now."""
        for position in positions:
            self._open.pop(position, None)
            self._done.pop(position, None)
            self._committed.pop(position, None)


@dataclasses.dataclass
class Taken:
    """What one intake took: `admitted` tasks in all, of which `tasks` decoded (with their messages, `sources`) and
    `diverted` dead-lettered."""
    sources: list[Message]
    tasks: list[TaskRecord]
    admitted: int

    @property
    def diverted(self) -> int:
        return self.admitted - len(self.tasks)


@dataclasses.dataclass
class Outcome:
    """One explored task, ready to deliver: its message, the workflow's result, extra group metadata."""
    source: Message
    result: GroupResult
    metadata: dict = dataclasses.field(default_factory=dict)


class TaskIntake:
    """Poll -> admit -> decode (the module docstring). Updates `stats.partitions` (the partitions held at the last
    poll) and `stats.admission_waits`. Reads through the consumer `membership.tasks` holds at each call.
    `refuse_images`: None when the workflow takes images, else why a task with images is dead-lettered."""

    def __init__(self, *, membership: Membership, admission: Admission, dead_letter: DeadLetter, run_id: str,
                 stats: ExplorerStats, images: ImageLimits | None = None, refuse_images: str | None = None):
        self.membership, self.admission, self.dead_letter = membership, admission, dead_letter
        self.run_id, self.stats, self.images = run_id, stats, images
        self.refuse_images = refuse_images

    def take(self, offsets: Offsets, *, timeout_s: float, max_records: int, wait: bool) -> Taken:
        """Poll up to `max_records` tasks (waiting up to `timeout_s` for the first), keep those admission lets start,
        open each in `offsets` and decode them; a dead-lettered one is done in `offsets` at once. When admission lets
        none start: count an admission wait and, when `wait`, wait for news (up to ADMISSION_WAIT_S)."""
        admitted = self._poll_admitted(timeout_s=timeout_s, max_records=max_records, wait=wait)
        for m in admitted:
            offsets.start(m.position, m.offset)
        sources, tasks = self._decode(admitted)
        kept = {id(m) for m in sources}
        for m in admitted:
            if id(m) not in kept:
                offsets.done(m.position, m.offset)
        return Taken(sources, tasks, len(admitted))

    def _poll_admitted(self, *, timeout_s: float, max_records: int, wait: bool) -> list[Message]:
        tasks = self.membership.consumer
        messages = tasks.poll(timeout_s=timeout_s, max_records=max_records)
        self.stats.partitions = sorted(parse_offset_key(p).partition for p in tasks.assignment())
        if not messages:
            return []
        admitted = self._admit(messages)
        if not admitted:
            self.stats.admission_waits += 1
            if wait:
                self.admission.wait(ADMISSION_WAIT_S)  # wakes on news, e.g. the trainer's next announcement
        return admitted

    def _admit(self, messages: list[Message]) -> list[Message]:
        n = max(0, min(len(messages), int(self.admission.admit(len(messages)))))
        taken, returned = messages[:n], messages[n:]
        rewind: dict[str, int] = {}
        for m in returned:  # poll() sorts by partition and offset: the first of each partition is the oldest
            rewind.setdefault(m.position, m.offset)
        if rewind:
            self.membership.consumer.seek(rewind)
        return taken

    def _decode(self, messages: list[Message]) -> tuple[list[Message], list[TaskRecord]]:
        sources, tasks = [], []
        for m, task in self.dead_letter.decode(messages, lambda v, h: decode_task(v, h, images=self.images)):
            if task.run_id != self.run_id:
                self.dead_letter.divert(m, f"foreign task: run {task.run_id!r}, this explorer serves {self.run_id!r}")
                continue
            if task.images and self.refuse_images is not None:
                self.dead_letter.divert(m, f"task cannot be explored: it has {len(task.images)} image(s) and "
                                           f"{self.refuse_images}")
                continue
            sources.append(m)
            tasks.append(task)
        return sources, tasks


class Delivery:
    """Produce -> acknowledge -> commit (the module docstring): the one way a task leaves the explorer.

    `deliver(outcomes, offsets)` produces one group (or dead letter) per outcome, flushes `sink`, waits up to
    `ack_timeout_s` for each group's acknowledgement (raises if the broker did not take one: nothing is committed),
    marks the outcomes done in `offsets`, commits `offsets.committable()` through `membership.tasks`, then counts
    (`stats.groups`, `stats.dead_letters`) and tells admission (`finish`: groups produced; `fail`: the other outcomes,
    plus `failed`, the admitted tasks dead-lettered at intake: every admitted task frees its slot once). Each group is
    numbered `(explorer_id, attempt)`: the attempt counts this explorer's earlier groups of the same group id (a
    re-delivery to the same explorer)."""

    def __init__(self, *, sink: RecordSink, dead_letter: DeadLetter, topics: RunTopics, explorer_id: str,
                 workflow: str, ack_timeout_s: float, admission: Admission, membership: Membership,
                 stats: ExplorerStats, rewards: RewardRange):
        self.sink, self.dead_letter, self.topics = sink, dead_letter, topics
        self.rewards = rewards  # a group with a reward outside it is dead-lettered, never produced
        self.explorer_id, self.workflow, self.ack_timeout_s = explorer_id, workflow, ack_timeout_s
        self.admission, self.membership, self.stats = admission, membership, stats
        self._attempts: collections.OrderedDict[str, int] = collections.OrderedDict()

    def deliver(self, outcomes: list[Outcome], offsets: Offsets, *, failed: int = 0) -> int:
        """Deliver `outcomes` (see the class docstring); returns the number of groups produced."""
        futures = [f for o in outcomes if (f := self._produce(o)) is not None]
        self.sink.flush()
        for future in futures:
            future.get(timeout=self.ack_timeout_s)  # raises if the broker did not take the group: nothing is committed
        for o in outcomes:
            offsets.done(o.source.position, o.source.offset)
        committable = offsets.committable()
        if committable and self._commit(committable):
            offsets.committed(committable)
        self.stats.groups += len(futures)
        self.stats.dead_letters = self.dead_letter.count
        if futures:
            self.admission.finish(len(futures))
        if given_up := len(outcomes) - len(futures) + failed:
            self.admission.fail(given_up)
        return len(futures)

    def _produce(self, outcome: Outcome) -> SendFuture | None:
        if outcome.result.error is not None:
            self.dead_letter.divert(outcome.source, f"task cannot be explored: {outcome.result.error}")
            return None
        group = self._group(outcome.result)
        group.metadata.update(outcome.metadata)
        for sample in group.samples:
            if sample.failure:
                self.stats.failed[sample.failure] = self.stats.failed.get(sample.failure, 0) + 1
        if problem := self.rewards.group_problem(group):
            self.dead_letter.divert(outcome.source, f"task cannot be explored: {problem}")
            return None
        try:
            return self.sink.send_record(self.topics.experiences, group, key=group.group_id)
        except RecordTooLarge as e:
            self.dead_letter.divert(outcome.source, f"experience group too large: {e}")
            return None
        except ClaimStoreUnavailable as e:  # past the store's retries; the group was not sent: counted, not fatal
            self.dead_letter.divert(outcome.source, f"experience group not sent: {e}")
            return None

    def _group(self, result: GroupResult) -> ExperienceGroup:
        task = result.task
        return ExperienceGroup(run_id=task.run_id, task_id=task.task_id, group_id=task.group_id,
                               attempt=self._next_attempt(task.group_id), explorer_id=self.explorer_id,
                               policy_version=result.policy_version, samples=result.samples, answer=task.answer,
                               metadata={"epoch": task.epoch, "prompt": task.prompt, "workflow": self.workflow},
                               greedy_reward=result.greedy_reward)

    def _next_attempt(self, group_id: str, remembered: int = 100_000) -> int:
        """How many times this explorer produced `group_id` before (so `(explorer_id, attempt)` names one
        attempt); re-deliveries to the same explorer count up."""
        attempt = self._attempts.pop(group_id, -1) + 1
        self._attempts[group_id] = attempt
        if len(self._attempts) > remembered:
            self._attempts.popitem(last=False)
        return attempt

    def _commit(self, offsets: dict[str, int]) -> bool:
        """Commit `offsets` (position -> next offset); False (logged) when the broker refused."""
        try:
            self.membership.consumer.commit(offsets)
        except Exception as e:  # a rebalance took the partitions: another explorer re-explores them
            log.warning("committing task offsets %s failed (%s: %s); those tasks will be explored again "
                        "and their duplicate groups dropped by group id", offsets, type(e).__name__, e)
            return False
        return True
