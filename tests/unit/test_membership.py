"""The explorer's membership rule (rft/explorer/membership.py) and the fleet health `rft status` derives, from known
sequences of control messages. The real broker and processes: tests/integration/test_group_stall.py."""
from __future__ import annotations

import pytest

from rft.config import ConfigError
from rft.explorer.config import ExplorerConfig
from rft.explorer.membership import UnassignedWatchdog, group_name, instance_id, partition_holders
from rft.ops.status import RunStatus, fleet_health, fleet_line
from rft.schema import ControlMessage
from rft.transport.control import ControlView


def heartbeat(explorer: str, at: float, partitions: list[int], groups: int = 0, unassigned_s: float = 0.0):
    return ControlMessage(kind="explorer_heartbeat", sender=explorer, created_at=at,
                          body={"explorer_id": explorer, "groups": groups, "partitions": partitions,
                                "unassigned_s": unassigned_s})


def view_of(*messages: tuple[ControlMessage, float]) -> ControlView:
    view = ControlView()
    for message, received_at in messages:
        view.apply(message, received_at=received_at)
    return view


def test_instance_id_is_a_legal_kafka_instance_id():
    assert instance_id("explorer-0") == "explorer-0"
    assert instance_id("host.example:1234/B-1") == "host.example_1234_B-1"
    assert instance_id("..") == "explorer.." and len(instance_id("x" * 400)) == 249


def test_group_names_by_epoch():
    assert group_name("r.explorers", 0) == "r.explorers" and group_name("r.explorers", 2) == "r.explorers.2"


def test_holders_are_live_peers_whose_newest_heartbeat_names_partitions():
    view = view_of((heartbeat("a", 100, [0, 1]), 100), (heartbeat("b", 100, [2, 3]), 100),
                   (heartbeat("c", 100, []), 100), (heartbeat("b", 105, []), 105),  # b lost its partitions
                   (heartbeat("old", 50, [0]), 50))  # not heard for 55 s: not live
    assert partition_holders(view, now=106, horizon_s=15) == ["a"]
    assert partition_holders(view, now=106, horizon_s=15, exclude="a") == []
    view.apply(ControlMessage("explorer_leave", "a", {"explorer_id": "a"}, created_at=107), received_at=107)
    assert partition_holders(view, now=108, horizon_s=15) == []


def test_watchdog_rejoins_only_after_the_bound_with_work_pending_and_no_holder():
    dog = UnassignedWatchdog(bound_s=30)
    dog.observe(held=True, now=0)
    dog.observe(held=False, now=10)
    assert not dog.due(now=39) and dog.due(now=41)
    # an idle extra member: its peers hold the partitions, it stays idle (and the lag is not even read)
    asked = []
    kept = dog.decide(41, pending=lambda: asked.append(1) or 5, holders=lambda: ["a"])
    assert not kept.rejoin and kept.holders == ["a"] and asked == []
    assert not dog.due(now=42)  # looks again a few seconds later, not on every poll
    # nothing pending: no rejoin either
    assert not dog.decide(50, pending=lambda: 0, holders=lambda: []).rejoin
    stalled = dog.decide(60, pending=lambda: 1752, holders=lambda: [])
    assert stalled.rejoin and stalled.pending == 1752 and stalled.unassigned_s == 50 and dog.rejoins == 1
    assert not stalled.move  # first a rejoin in the same group
    assert dog.unassigned_s(now=80) == 70  # what it reports keeps counting across rejoins
    assert not dog.due(now=80) and dog.due(now=91)  # a full bound again before the next step
    again = dog.decide(91, pending=lambda: 1752, holders=lambda: [])
    assert again.rejoin and again.move and dog.rejoins == 2  # the rejoin did not help: move to a fresh group
    dog.observe(held=True, now=92)
    assert dog.unassigned_s(now=200) == 0 and not dog.due(now=200)
    dog.observe(held=False, now=200)
    assert not dog.decide(231, pending=lambda: 1, holders=lambda: []).move  # a new stall starts with a rejoin
    assert not UnassignedWatchdog(bound_s=0).due(now=1e9)  # 0: off


def test_unassigned_rejoin_s_must_not_be_negative():
    with pytest.raises(ConfigError, match="explorer.unassigned_rejoin_s"):
        ExplorerConfig(unassigned_rejoin_s=-1)


def test_status_says_stalled_when_no_explorer_holds_a_partition_and_idle_members_otherwise():
    status = RunStatus(heartbeat_s=5.0)
    for m in (heartbeat("explorer-0", 100, [], unassigned_s=20), heartbeat("explorer-1", 101, [], unassigned_s=25),
              heartbeat("explorer-0", 105, [], unassigned_s=25), heartbeat("explorer-1", 106, [], unassigned_s=30)):
        status.apply(m)
    status.finish(now=110)
    fleet = fleet_health(status, now=110, task_partitions=4, pending=1752)
    assert fleet["stalled"] == "STALLED: 1752 tasks pending, no explorer holds a partition for 30 s"
    assert fleet_line(fleet) == "explorers idle: 2 of 2 (4 task partitions)"
    assert fleet_health(status, now=110, task_partitions=4, pending=0)["stalled"] is None

    # six explorers on four partitions, all consuming: two idle, no stall
    status = RunStatus(heartbeat_s=5.0)
    for i in range(6):
        status.apply(heartbeat(f"e{i}", 100, [i] if i < 4 else [], groups=1))
        status.apply(heartbeat(f"e{i}", 105, [i] if i < 4 else [], groups=3 if i < 4 else 0))
    fleet = fleet_health(status, now=106, task_partitions=4, pending=40)
    assert fleet["stalled"] is None and fleet_line(fleet) == "explorers idle: 2 of 6 (4 task partitions)"


def test_status_says_stalled_when_the_trainer_waits_and_explorers_produce_nothing():
    status = RunStatus(heartbeat_s=5.0)
    status.apply(ControlMessage("trainer_waiting", "trainer", {"version": 39, "offsets": {}}, created_at=100))
    for t in range(100, 200, 5):
        status.apply(heartbeat("explorer-0", t, [0, 1], groups=7))  # holds partitions, produces nothing
    fleet = fleet_health(status, now=200, task_partitions=2, pending=12)
    assert fleet["stalled"] == ("STALLED: 12 tasks pending, the trainer waits and the explorers produced nothing "
                                "for 100 s")
    assert fleet_health(status, now=150, task_partitions=2, pending=12)["stalled"] is None  # within the window
