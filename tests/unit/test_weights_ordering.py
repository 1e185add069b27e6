"""The ordering contract of weight synchronisation (rft/weights/__init__.py), with small in-memory fakes: no broker,
no torch.distributed. Publisher: pull stores before it announces, push announces before it sends and falls back to
pull after a failure. Subscriber: the newest of the store and the announcements, never backwards, push groups
joined and left as announced."""
from __future__ import annotations

import threading

import pytest
import torch

from rft.schema import encode
from rft.transport.control import Kind, PushAbandoned, PushGroup, Weights, WeightsPush
from rft.weights.config import SyncConfig
from rft.weights.publisher import WeightPublisher
from rft.weights.push import PushError, PushGroupSpec
from rft.weights.store import INDEX, WeightStore
from rft.weights.subscriber import PushMembership, WeightUpdates, load_newest_weights


def buckets(version: int) -> list[dict]:
    return [{"w": torch.full((2,), float(version))}]


# ----------------------------------------------------------------------------------------------- publisher

def test_pull_stores_the_whole_version_and_moves_latest_before_it_announces(tmp_path):
    store, seen = WeightStore(tmp_path), []

    def announce(message: Kind) -> None:  # what an explorer would find at the moment of the announcement
        path = store.path(message.version)
        seen.append((message, store.latest(), (path / INDEX).is_file()))

    for write_behind in (False, True):
        seen.clear()
        publisher = WeightPublisher(SyncConfig(write_behind=write_behind), store=store, announce=announce, hf_dir=None)
        version = 2 if write_behind else 1
        assert publisher.deliver(version, buckets(version), offsets={"x:0": 4})
        publisher.flush()
        (message, latest, complete), = seen
        assert message == Weights(version=version, path=str(store.path(version)), offsets={"x:0": 4},
                                  lineage=store.read_lineage().id)  # the store's, as its manifest names it
        assert latest == (version, store.path(version)) and complete
        assert publisher.last_write_s is not None and publisher.last_write_s >= 0


def test_write_behind_stores_the_weights_as_they_were_and_announces_in_order(tmp_path):
    """deliver returns before the write; the trainer's next step may change its tensors in place meanwhile."""
    store, announced, release = WeightStore(tmp_path, keep=10), [], threading.Event()

    def announce(message: Kind) -> None:
        release.wait(5)  # the background write is still going on when deliver returns
        announced.append(message.version)

    publisher = WeightPublisher(SyncConfig(), store=store, announce=announce, hf_dir=None)
    live = {"w": torch.zeros(3)}
    for version in (1, 2, 3):
        live["w"].fill_(float(version))
        release.set() if version == 3 else None
        assert publisher.deliver(version, [live], offsets={})
        live["w"].fill_(-1.0)  # the next optimizer step
    publisher.flush()
    assert announced == [1, 2, 3]
    assert [dict(store.iter_tensors(v))["w"].tolist() for v in (1, 2, 3)] == [[1.0] * 3, [2.0] * 3, [3.0] * 3]


def test_a_failed_background_write_surfaces_at_the_next_deliver_and_at_flush(tmp_path):
    def announce(message: Kind) -> None:
        raise TimeoutError("broker unreachable")

    publisher = WeightPublisher(SyncConfig(), store=WeightStore(tmp_path), announce=announce, hf_dir=None)
    assert publisher.deliver(1, buckets(1), offsets={})
    with pytest.raises(RuntimeError, match="publishing weights in the background failed: broker unreachable"):
        publisher.deliver(2, buckets(2), offsets={})  # version 1's failure stops the trainer before version 2
    publisher.flush()  # reported once

    publisher.deliver(3, buckets(3), offsets={})
    with pytest.raises(RuntimeError, match="broker unreachable"):
        publisher.flush()  # the trainer flushes before a checkpoint and at the end


class FakeSender:
    """A push group's rank 0 that records what happens, in order, in a log shared with the announcements."""

    def __init__(self, log: list, *, members: int = 2, joined_after: int = 0, fail_at: int | None = None):
        self.log, self.fail_at, self._polls, self.joined_after = log, fail_at, 0, joined_after
        self.spec = PushGroupSpec(group_id="g1", host="h", port=1, world_size=1 + members, backend="gloo",
                                  timeout_s=5.0)

    def members_joined(self) -> int:
        self._polls += 1
        return self.spec.world_size - 1 if self._polls > self.joined_after else 0

    def connect(self) -> None:
        self.log.append("connect")

    def send(self, version: int, buckets) -> float:
        self.log.append(f"send {version}")
        if version == self.fail_at:
            raise PushError("a member died")
        list(buckets)
        self.log.append(f"sent {version}")
        return 8.0

    def close(self) -> None:
        self.log.append("close")


def push_publisher(tmp_path, log: list, sender: FakeSender) -> WeightPublisher:
    publisher = WeightPublisher(SyncConfig(method="push"), store=WeightStore(tmp_path), hf_dir=None, sender=sender,
                                announce=lambda m: log.append((type(m).__name__, getattr(m, "version", None))))
    publisher.ANNOUNCE_EVERY_S = 0
    return publisher


def test_push_announces_the_group_until_it_is_full_then_each_version_before_sending_it(tmp_path):
    log: list = []
    publisher = push_publisher(tmp_path, log, FakeSender(log, joined_after=2))
    for version in (0, 1):
        assert publisher.deliver(version, buckets(version), offsets={})
        log.append(f"step {version + 1} starts")  # the trainer goes on only after deliver returned
    assert log == [("PushGroupSpec", None), ("PushGroupSpec", None), "connect",
                   ("WeightsPush", 0), "send 0", "sent 0", "step 1 starts",
                   ("WeightsPush", 1), "send 1", "sent 1", "step 2 starts"]


def test_a_failed_push_is_abandoned_and_the_version_then_pulled(tmp_path):
    log: list = []
    publisher = push_publisher(tmp_path, log, FakeSender(log, fail_at=1))
    assert publisher.deliver(0, buckets(0), offsets={})
    assert not publisher.deliver(1, buckets(1), offsets={})  # the caller gathers the buckets again ...
    assert publisher.deliver(1, buckets(1), offsets={})  # ... and the same version takes the pull path
    assert publisher.deliver(2, buckets(2), offsets={})
    publisher.flush()  # the pull path writes behind
    assert log == ["connect", ("WeightsPush", 0), "send 0", "sent 0",
                   ("WeightsPush", 1), "send 1", ("PushAbandoned", 1), "close",
                   ("Weights", 1), ("Weights", 2)]
    assert WeightStore(tmp_path).latest()[0] == 2


def test_a_group_that_never_fills_is_abandoned_within_the_timeout(tmp_path):
    log: list = []
    sender = FakeSender(log, joined_after=10 ** 9)
    sender.spec = PushGroupSpec(**{**sender.spec.body(), "timeout_s": 0.0})
    publisher = push_publisher(tmp_path, log, sender)
    assert not publisher.deliver(0, buckets(0), offsets={})
    assert ("PushAbandoned", 0) in log and "connect" not in log and publisher.method == "pull"


# ---------------------------------------------------------------------------------------------- subscriber

class FakeControl:
    """A control-topic source: what was announced since the last poll."""

    def __init__(self):
        self.pending: list = []

    def announce(self, message: Kind) -> None:
        value, headers = encode(message.to_message())
        self.pending.append(type("Record", (), {"value": value, "headers": headers})())

    def poll(self, timeout_s: float = 1.0, max_records: int | None = None) -> list:
        polled, self.pending = self.pending, []
        return polled

    def close(self) -> None:
        pass


class FakeEngine:
    def __init__(self, version: int = 0, pushed: list[int] = ()):
        self.weights_version, self.pushed, self.log = version, list(pushed), []

    def load_weights(self, path, version: int) -> None:
        self.log.append(("load", version))
        self.weights_version = version

    def join_push_group(self, spec: dict) -> None:
        self.log.append(("join", spec["group_id"]))

    def receive_pushed_weights(self) -> int:
        version = self.pushed.pop(0)
        self.log.append(("receive", version))
        self.weights_version = version
        return version

    def leave_push_group(self) -> None:
        self.log.append(("leave",))


def test_the_newest_of_latest_and_announcements_is_loaded_and_never_an_older_one(tmp_path):
    store, control = WeightStore(tmp_path / "store", keep=5), FakeControl()
    updates, engine = WeightUpdates(store, control), FakeEngine()
    store.publish(1, buckets(1), hf_dir=None)
    assert load_newest_weights(engine, updates.newest)[0] == 1  # from the store's LATEST

    store.publish(3, buckets(3), hf_dir=None)
    (store.root / "LATEST").write_text("1\n")  # LATEST not moved yet: only the announcement tells
    control.announce(Weights(version=3, path="/elsewhere"))  # not readable here: the same version in this store
    assert load_newest_weights(engine, updates.newest)[0] == 3

    control.announce(Weights(version=2, path=str(store.path(3))))  # an older announcement, read late
    assert updates.newest()[0] == 3 and load_newest_weights(engine, updates.newest) is None
    assert engine.log == [("load", 1), ("load", 3)]


def test_push_membership_joins_receives_leaves_and_joins_a_new_group(tmp_path):
    control, engine = FakeControl(), FakeEngine(pushed=[1, 2, 5])
    membership = PushMembership(engine, WeightUpdates(WeightStore(tmp_path), control))
    group = dict(host="h", port=1, world_size=2, backend="gloo", timeout_s=1.0)
    control.announce(PushGroup(group_id="g1", **group))
    assert membership.sync() == [] and membership.group_id == "g1"
    control.announce(WeightsPush(group_id="g1", version=1))
    control.announce(WeightsPush(group_id="g1", version=2))
    assert membership.sync() == [1, 2]
    control.announce(PushAbandoned(group_id="g1", version=3))
    control.announce(PushGroup(group_id="g1", **group))  # a re-announcement read late: not joined again
    assert membership.sync() == [] and membership.group_id is None
    control.announce(PushGroup(group_id="g2", **group))  # a restarted trainer's new group
    control.announce(WeightsPush(group_id="g2", version=5))
    assert membership.sync() == [5]
    assert engine.log == [("join", "g1"), ("receive", 1), ("receive", 2), ("leave",), ("join", "g2"), ("receive", 5)]


def test_a_push_that_fails_part_way_keeps_the_engine_from_generating_until_a_whole_version_loads(tmp_path):
    """A receive that fails after some tensors were loaded leaves vLLM's engine part-loaded (layers it had not
    reached stay on the meta device): the membership says `engine_whole` False until a whole version arrives,
    by a later push or by pull (`loaded()`), and the explorer does not generate meanwhile (Explorer.run).
    The failure is an in-memory engine raising, as gloo does when a peer dies mid-broadcast."""
    class FailingOnce(FakeEngine):
        def receive_pushed_weights(self) -> int:
            if self.pushed[0] == 2:
                self.pushed.pop(0)
                raise RuntimeError("broadcast: Connection closed by peer")
            return super().receive_pushed_weights()

    control, engine = FakeControl(), FailingOnce(pushed=[1, 2, 5])
    membership = PushMembership(engine, WeightUpdates(WeightStore(tmp_path), control))
    group = dict(host="h", port=1, world_size=2, backend="gloo", timeout_s=1.0)
    control.announce(PushGroup(group_id="g1", **group))
    control.announce(WeightsPush(group_id="g1", version=1))
    assert membership.sync() == [1] and membership.engine_whole
    control.announce(WeightsPush(group_id="g1", version=2))
    assert membership.sync() == [] and membership.group_id is None and not membership.engine_whole
    membership.loaded()  # version 2, redone by pull, was loaded
    assert membership.engine_whole
    membership.engine_whole = False
    control.announce(PushGroup(group_id="g2", **group))
    control.announce(WeightsPush(group_id="g2", version=5))
    assert membership.sync() == [5] and membership.engine_whole  # a whole pushed version also restores it
