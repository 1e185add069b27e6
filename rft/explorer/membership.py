"""An explorer's membership in the tasks consumer group `<run>.explorers`: its static instance id, and the
watchdog that rejoins a group in which nobody consumes.

Static membership (`explorer.static_membership`, KIP-345): the explorer joins with `group_instance_id` =
`instance_id(explorer_id)`, so a restarted explorer with the same `--explorer-id` takes its old place without a
rebalance of the whole fleet, on a broker that honours it (Apache Kafka >= 2.3). A static member sends no
LeaveGroup when it closes: its partitions wait for it until `kafka.session_timeout_ms` has passed. The bundled
Tansu broker ignores instance ids (docs/operations.md, "Consumer-group membership"), so there every
join, leave and restart rebalances the group as for dynamic members.

The watchdog (`UnassignedWatchdog`, `explorer.unassigned_rejoin_s`): a consumer group on Tansu can wedge with every
member live and none holding a partition (tests/integration/test_group_stall.py reproduces it). When this explorer has
held no partition for that long, the group has lag and no live explorer holds one, it rejoins; if that did not help,
it moves the fleet to a fresh consumer group (`<run>.explorers.<epoch>`, seeded with the old group's committed
offsets) and announces it (`tasks_group`); every explorer follows the highest epoch. Delivery stays at-least-once.
The class docstring has the rule, what was seen, and its timing.

`Membership` is the explorer's side of all this: its tasks consumer, the group's epoch, and the watchdog's steps taken
between deliveries.

Readers of the explorers' lag besides `rft status` (the online task publisher, `rft publish`) follow the moves with
a `GroupFollower`.

"""
from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from rft.schema import ControlMessage
from rft.transport import Transport, TransportError, lag
from rft.transport.control import ControlView, TasksGroup, control_messages

if TYPE_CHECKING:
    from rft.explorer.config import ExplorerConfig
    from rft.explorer.stats import ExplorerStats
    from rft.observability.prometheus import MetricsEndpoint
    from rft.transport import RecordSink, RecordSource
    from rft.transport.config import KafkaConfig
    from rft.transport.run_topics import RunTopics
    from rft.weights.subscriber import WeightUpdates

log = logging.getLogger(__name__)

_ILLEGAL = re.compile(r"[^A-Za-z0-9._-]")
RECHECK_MOVE_S = 10.0  # how often a move refused for rewinding the fleet is looked at again


def instance_id(explorer_id: str) -> str:
    """The consumer group instance id for `explorer_id`: the id with characters Kafka does not allow in an instance
    id replaced by `_`, at most 249 characters. Two explorers of a run must not share one (the broker fences the
    older: FencedInstanceIdError)."""
    cleaned = _ILLEGAL.sub("_", explorer_id)[:249]
    return cleaned if cleaned not in ("", ".", "..") else f"explorer{cleaned}"


def group_name(base: str, epoch: int) -> str:
    """The explorers' consumer group of `epoch`: `base` (`<run>.explorers`) for 0, `base.<epoch>` after moves."""
    return base if epoch == 0 else f"{base}.{epoch}"


def announced_group(transport: Transport, control_topic: str, *, client_id: str) -> TasksGroup | None:
    """The highest-epoch `tasks_group` announcement on the control topic (read from its beginning), None if none.
    Moves are applied in epoch order (those sent before moves had one key may sit in several partitions, read in no
    global order), so the view's one-epoch-at-a-time rule still refuses a forged far epoch."""
    source = transport.source(client_id=client_id)
    try:
        view = ControlView()
        moves = [m for m in control_messages(source.read_range(control_topic, idle_timeout_s=10.0))
                 if m.kind == TasksGroup.KIND]
        for message in sorted(moves, key=_epoch_of):
            view.apply(message)
        return view.tasks_group
    finally:
        source.close()


def _epoch_of(message: ControlMessage) -> int:
    """A `tasks_group` message's epoch for ordering (a malformed one sorts first; the view refuses it)."""
    epoch = message.body.get("epoch")
    return epoch if isinstance(epoch, int) and not isinstance(epoch, bool) else -1


class GroupFollower:
    """The explorers' current consumer group on the tasks topic, as the control topic's `tasks_group` moves say: the
    newest at construction (a replay), then each new one as `group` is read. Not thread-safe."""

    def __init__(self, transport: Transport, base_group: str, control_topic: str, *, client_id: str):
        self.base_group = base_group
        self.view = ControlView()
        announced = announced_group(transport, control_topic, client_id=client_id)
        if announced is not None:
            self.view.tasks_group = announced
        self._source = transport.source(client_id=client_id)
        self._source.assign([control_topic])
        self._source.seek(self._source.end_offsets(control_topic))

    @property
    def group(self) -> str:
        self.view.apply_records(self._source.poll(timeout_s=0))
        moved = self.view.tasks_group
        return group_name(self.base_group, 0 if moved is None else moved.epoch)

    def close(self) -> None:
        self._source.close()


def seed_group(transport: Transport, group: str, topic: str, offsets: dict[str, int], *, client_id: str) -> bool:
    """Commit `offsets` (of `topic`'s partitions) as consumer group `group`'s positions, without joining it. False
    (logged) when the broker refuses: the group has members already (another explorer moved first, seeding the same
    offsets), and their positions stand."""
    source = transport.source(group=group, client_id=client_id)
    try:
        source.assign([topic])
        if offsets:
            source.commit(offsets)
        return True
    except Exception as e:  # the broker's refusal comes as the client's own error type
        log.warning("seeding consumer group %s with %s failed (%s: %s); its members' positions stand", group, offsets,
                    type(e).__name__, e)
        return False
    finally:
        source.close()


def move_group(transport: Transport, topics: RunTopics, *, epoch: int, offsets: dict[str, int], by: str,
               sink: RecordSink) -> str:
    """Seed the explorers' group of `epoch` with `offsets` (the tasks topic's "topic:partition" -> next offset), then
    announce it on the control topic (`tasks_group`, from `by`) through `sink`: every explorer follows the announcement
    of the highest epoch. The group's name."""
    target = group_name(topics.explorers_group, epoch)
    seed_group(transport, target, topics.tasks, offsets, client_id=f"{by}-seed")
    moved = TasksGroup(explorer_id=by, group=target, epoch=epoch, offsets=offsets)
    # one key: every move in one partition of the control topic, read in the order sent (the view accepts a move
    # only to the epoch after the one in force)
    sink.send_record(topics.control, moved.to_message(), key=TasksGroup.KIND)
    sink.flush()
    return target


def fresh_group_for_restart(transport: Transport, topics: RunTopics, *, by: str) -> str | None:
    """Before a restarted run's explorers join (`rft run` again over topics its explorers consumed from): move the
    fleet to the next epoch's group, seeded with the current group's committed offsets, and return its name; None,
    with nothing done, when the current group has committed nothing (the run's first start).

    Why: when a whole fleet stops at once (a run that ends or dies stops its explorers together), the last members'
    LeaveGroups cross an election, and on the bundled Tansu broker that leaves the group wedged (the module
    docstring): the restarted explorers would hold nothing until the watchdog moved them, 2 x
    `explorer.unassigned_rejoin_s` later (docs/benchmarks.md, "Chaos").
    A fresh group has no history to be wedged by. Explorers still live from elsewhere follow the announcement too;
    tasks their old group delivered but had not committed are explored again (at least once, as in any move)."""
    announced = announced_group(transport, topics.control, client_id=f"{by}-groups")
    epoch = 0 if announced is None else announced.epoch
    source = transport.source(group=group_name(topics.explorers_group, epoch), client_id=by)
    try:
        offsets = {k: v for k, v in source.committed(topics.tasks).items() if v is not None}
    finally:
        source.close()
    if not offsets:
        return None
    sink = transport.sink(client_id=by, linger_ms=0)
    try:
        return move_group(transport, topics, epoch=epoch + 1, offsets=offsets, by=by, sink=sink)
    finally:
        sink.close()


def partition_holders(view: ControlView, *, now: float, horizon_s: float, exclude: str = "") -> list[str]:
    """Explorers (other than `exclude`) that have not left, were heard within `horizon_s` of `now` (the time
    `view` received their newest message, this process's clock) and whose newest heartbeat names partitions."""
    return sorted(e for e, heard in view.heard.items()
                  if e != exclude and now - heard <= horizon_s and view.explorers[e].state == "live"
                  and view.explorers[e].partitions)


def describe_peers(view: ControlView, *, now: float, exclude: str = "") -> str:
    """`explorer-0 [0, 1] 0.8 s ago, ...`: each peer's newest heartbeat partitions and when it was heard (for logs)."""
    return ", ".join(f"{e} {view.explorers[e].partitions} {now - heard:.1f} s ago {view.explorers[e].state}"
                     for e, heard in sorted(view.heard.items()) if e != exclude) or "none heard"


@dataclass
class Decision:
    """One look at the group: act or not (`rejoin`), how (`move`: to a fresh group, after a rejoin did not help), and
    why (logged and counted by the explorer)."""
    rejoin: bool
    unassigned_s: float
    pending: int
    holders: list[str]
    move: bool = False


class UnassignedWatchdog:
    """The rule below, fed by the explorer's loop. `observe(held, now)` after every poll;
    when `due(now)`, the caller measures the group's lag and the fleet's holders (broker requests: only then)
    and calls `decide`. Times are `time.monotonic()` seconds. `bound_s` <= 0 turns it off.

    The rule, and why. Seen on Tansu after quick join/leave cycles: every member of the group live, none holding a
    partition, the tasks topic's lag growing, nothing ever rebalancing it. Reproduced here with Tansu 0.6.0 and
    kafka-python 3.0.12 (tests/integration/test_group_stall.py): the group's leader leaves (LeaveGroup) just as it is
    elected, before its SyncGroup; the coordinator keeps it as the leader, so every later member's SyncGroup ends in
    REBALANCE_IN_PROGRESS, it joins again, forever, holding nothing; new members, static members and a group that every
    member left stay wedged the same way (almost always: once, in a suite run, two explorers' rejoins at the same
    instant unwedged it). So the watchdog acts in two steps when, all at once,
      1. it has held no partition of the tasks topic for longer than `unassigned_rejoin_s`;
      2. the group's lag on the tasks topic (end offsets minus the group's committed offsets) is > 0: there is work;
      3. no other live explorer holds a partition: none of the explorers heard on the control topic within three
         heartbeat intervals said in its newest heartbeat that it holds one.
    then:
      a. first, it rejoins the group (closes its consumer and joins again as a dynamic member, which makes a working
         coordinator rebalance; on Kafka this is what a new member's join does);
      b. if the rule holds again a full `unassigned_rejoin_s` later, it moves the fleet to a fresh consumer group:
         `group_name(base, epoch + 1)` (`<run>.explorers.1`, ...), seeded with the old group's committed offsets, and
         announces it on the control topic (`tasks_group`); every explorer follows the announcement of the highest
         epoch, a starting explorer replays the control topic for it (`announced_group`), and `rft status` reads the
         lag of that group. Two explorers moving at once pick the same name and seed the same offsets.
    Delivery stays at-least-once: tasks polled but not committed in the old group are explored again. An explorer left
    idle because the fleet outgrew the partitions sees its peers' heartbeats with partitions (rule 3) and stays idle: it
    never churns the group. A member holding partitions but stopped (SIGSTOP, a hung host) stops heartbeating and is no
    longer live; the coordinator drops it after the session timeout and rebalances, and if it does not, the watchdog's
    rejoin forces it. After every rejoin, move or follow the watchdog waits another full `unassigned_rejoin_s` before
    the next step: make it well above the time the group needs to form (Tansu answers a JoinGroup after 3 s; a rebalance
    waits for every member's next poll, up to `explorer.max_batch_s`)."""

    def __init__(self, bound_s: float):
        self.bound_s = bound_s
        self.unassigned_since: float | None = None  # since when this explorer has held no partition (reported)
        self._clock: float | None = None  # since the later of that and its last (re)join: when the next step is due
        self._next_look = 0.0
        self.rejoins = 0  # actions taken (rejoins and moves)
        self._tries = 0  # actions since this explorer last held a partition

    def observe(self, held: bool, now: float) -> None:
        if held:
            self.unassigned_since = self._clock = None
            self._tries = 0
        elif self.unassigned_since is None:
            self.unassigned_since = self._clock = now

    def restart(self, now: float) -> None:
        """This explorer (re)joined a group at `now`: the next step waits a full bound from here."""
        if self._clock is not None:
            self._clock = now

    def unassigned_s(self, now: float) -> float:
        return 0.0 if self.unassigned_since is None else now - self.unassigned_since

    def due(self, now: float) -> bool:
        """Unassigned for longer than the bound, and not looked within the last few seconds."""
        return (self.bound_s > 0 and self._clock is not None and now - self._clock > self.bound_s
                and now >= self._next_look)

    def decide(self, now: float, pending: Callable[[], int], holders: Callable[[], list[str]]) -> Decision:
        """Look (`pending()`: the group's lag on the tasks topic; `holders()`: live peers holding partitions) and
        decide; a rejoin restarts the unassigned clock."""
        self._next_look = now + min(5.0, self.bound_s / 3)
        waited = self.unassigned_s(now)
        peers = holders()
        lag = pending() if not peers else 0
        rejoin = lag > 0 and not peers
        if rejoin:
            self.rejoins += 1
            self._tries += 1
            self._clock = now
        return Decision(rejoin, waited, lag, peers, move=rejoin and self._tries > 1)


class Membership:
    """This explorer's place in the explorers' consumer group on the tasks topic: the consumer it reads tasks with
    (`tasks`; None before `join` and while it switches groups), the group's `epoch`, and the watchdog (`watch`).

    It reads the control topic through `control` (the explorer's WeightUpdates: its `view` holds the fleet's newest
    heartbeats and `tasks_group` move, `read_announcements()` reads what is new), announces a move it makes on `sink`,
    reads `stats.partitions` (set at each poll) and writes `stats.rejoins`; with `prometheus`, it exports its gauges
    (`rft_explorer_partitions`, `rft_explorer_unassigned_seconds`, `rft_explorer_rejoins_total`). Called by the
    explorer's loop only (not thread-safe); the heartbeat thread reads `tasks` and `watchdog`."""

    def __init__(self, *, transport: Transport, topics: RunTopics, explorer_id: str, config: ExplorerConfig,
                 kafka: KafkaConfig, control: WeightUpdates, sink: RecordSink, stats: ExplorerStats,
                 prometheus: MetricsEndpoint | None = None):
        self.transport, self.topics, self.explorer_id = transport, topics, explorer_id
        self.config, self.kafka, self.control, self.sink = config, kafka, control, sink
        self.stats, self.prometheus = stats, prometheus
        self.tasks: RecordSource | None = None
        self.epoch = 0  # the group is group_name(topics.explorers_group, epoch)
        self.watchdog = UnassignedWatchdog(config.unassigned_rejoin_s)
        self._move_checked: dict[int, float] = {}  # epoch -> when a move to it was last refused (_may_follow)

    @property
    def group(self) -> str:
        return group_name(self.topics.explorers_group, self.epoch)

    @property
    def consumer(self) -> RecordSource:
        """`tasks`, once joined (RuntimeError before `join`)."""
        if self.tasks is None:
            raise RuntimeError(f"explorer {self.explorer_id} reads tasks before joining the tasks consumer group")
        return self.tasks

    def join(self) -> None:
        """Join the group the newest `tasks_group` announcement names (the run's base group when none), as a static
        member when `explorer.static_membership`."""
        announced = announced_group(self.transport, self.topics.control, client_id=f"{self.explorer_id}-groups")
        if announced is not None:
            self.epoch = announced.epoch
            self.control.view.tasks_group = announced  # the epoch in force: the next move is its successor
        self._subscribe(static=self.config.static_membership)

    def watch(self) -> bool:
        """Between deliveries: follow a newer `tasks_group` move; then the rule of `UnassignedWatchdog`: rejoin the
        group when this explorer has held no partition for `explorer.unassigned_rejoin_s` while the group has lag and
        no live explorer holds one, and move the fleet to a fresh group when a rejoin did not help. True when it
        switched to a new consumer (the group re-delivers whatever the old one had not committed)."""
        before = self.tasks
        now = time.monotonic()
        moved = self.control.view.tasks_group
        if moved is not None and moved.epoch > self.epoch and self._may_follow(moved, now):
            log.warning("explorer %s follows %s to consumer group %s", self.explorer_id, moved.explorer_id, moved.group)
            self._switch(moved.epoch)
        self.watchdog.observe(bool(self.stats.partitions), now)
        if self.prometheus is not None:
            self.prometheus.update({"rft_explorer_partitions": len(self.stats.partitions),
                                    "rft_explorer_unassigned_seconds": self.watchdog.unassigned_s(now),
                                    "rft_explorer_rejoins_total": self.watchdog.rejoins})
        if self.watchdog.due(now):
            self._act(now)
        return self.tasks is not before

    def _may_follow(self, moved: TasksGroup, now: float) -> bool:
        """Whether the group of `moved` holds the tasks topic's committed offsets of the group in force, not behind on
        any partition: a move seeds its group first (`move_group`), so one that would rewind the fleet (a forged
        announcement of a group nobody seeded: its members would read from the earliest offset) is refused, counted
        in the view's `malformed` and looked at again every RECHECK_MOVE_S (its mover may seed it yet)."""
        if now < self._move_checked.get(moved.epoch, -RECHECK_MOVE_S) + RECHECK_MOVE_S:
            return False
        target = group_name(self.topics.explorers_group, moved.epoch)
        try:
            mine = self.consumer.committed(self.topics.tasks)
            reader = self.transport.source(group=target, client_id=f"{self.explorer_id}-check")
            try:
                theirs = reader.committed(self.topics.tasks)
            finally:
                reader.close()
        except TransportError as e:
            log.warning("explorer %s: cannot read the committed offsets of %s (%s); following later", self.explorer_id,
                        target, e)
            self._move_checked[moved.epoch] = now
            return False
        behind = {k: (theirs.get(k), v) for k, v in mine.items() if v is not None and (theirs.get(k) or 0) < v}
        if not behind:
            return True
        if moved.epoch not in self._move_checked:
            self.control.view.refuse(moved.explorer_id, f"tasks_group: epoch {moved.epoch}'s group {target} would "
                                     f"rewind the tasks topic (its committed offsets vs {self.group}'s: {behind})")
        self._move_checked[moved.epoch] = now
        return False

    def _act(self, now: float) -> None:
        horizon_s = 3 * self.config.heartbeat_s
        self.control.read_announcements()
        view = self.control.view
        decision = self.watchdog.decide(now, pending=self._tasks_pending,
                                        holders=lambda: partition_holders(view, now=time.time(), horizon_s=horizon_s,
                                                                          exclude=self.explorer_id))
        if not decision.rejoin:
            return
        self.stats.rejoins = self.watchdog.rejoins
        if decision.move:
            self._move(decision)
            return
        log.warning("explorer %s held no tasks partition for %.0f s while %d tasks wait and no live explorer holds "
                    "one (peers: %s): rejoining the consumer group %s", self.explorer_id, decision.unassigned_s,
                    decision.pending, describe_peers(view, now=time.time(), exclude=self.explorer_id), self.group)
        self._switch(self.epoch)

    def _move(self, decision: Decision) -> None:
        """Seed the next epoch's group with this group's committed offsets, announce it (`tasks_group`), join it."""
        epoch = self.epoch + 1
        try:
            offsets = {k: v for k, v in self.consumer.committed(self.topics.tasks).items() if v is not None}
        except TransportError as e:
            log.warning("membership watchdog: cannot read group %s's committed offsets (%s); not moving now",
                        self.group, e)
            return
        log.warning("explorer %s: consumer group %s still gives nobody a partition after a rejoin (%d tasks wait): "
                    "moving the explorers to %s", self.explorer_id, self.group, decision.pending,
                    group_name(self.topics.explorers_group, epoch))
        move_group(self.transport, self.topics, epoch=epoch, offsets=offsets, by=self.explorer_id, sink=self.sink)
        self._switch(epoch)

    def _subscribe(self, static: bool) -> None:
        # a batch may take up to explorer.max_batch_s between two polls; the group must not presume us dead
        self.tasks = self.transport.source(group=self.group, topics=[self.topics.tasks], client_id=self.explorer_id,
                                           max_poll_interval_ms=max(self.kafka.max_poll_interval_ms,
                                                                    int(self.config.max_batch_s * 1000)),
                                           group_instance_id=instance_id(self.explorer_id) if static else None)

    def _switch(self, epoch: int) -> None:
        """Leave the tasks group and join the group of `epoch` (the same one: a rejoin), as a dynamic member: a static
        member that rejoins may be handed its old (empty) assignment."""
        self.consumer.close()
        self.tasks = None
        self.epoch = epoch
        self._subscribe(static=False)
        self.watchdog.restart(time.monotonic())

    def _tasks_pending(self) -> int:
        """The group's lag on the tasks topic (records past its committed offsets); 0 when unreadable."""
        try:
            tasks = self.consumer
            end = tasks.end_offsets(self.topics.tasks)
            committed = tasks.committed(self.topics.tasks)
            start = tasks.beginning_offsets(self.topics.tasks)
        except TransportError as e:
            log.warning("membership watchdog: cannot read the tasks topic's offsets (%s)", e)
            return 0
        return lag(end, {k: start.get(k, 0) if v is None else v for k, v in committed.items()})

    def close(self) -> None:
        if self.tasks is not None:
            self.tasks.close()
