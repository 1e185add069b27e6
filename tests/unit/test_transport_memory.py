"""rft.transport.memory, the in-memory transport of the unit tests: the scenarios of tests/transport_scenarios.py
(which tests/integration/test_transport_fidelity.py runs on the real broker too), consumer groups sharing
partitions, retention and fetch (that neither imports kafka-python: tests/integration/test_transport_imports.py)."""
from __future__ import annotations

import pytest

from rft.transport import Position, TransportError, lag, offset_key, parse_offset_key, parse_positions, parse_time_ms
from rft.transport.memory import MemoryTransport
from tests import transport_scenarios as scenarios


@pytest.mark.parametrize("scenario", scenarios.SCENARIOS, ids=lambda s: s.__name__)
def test_scenario(scenario):
    scenario(MemoryTransport(partitions=2), "t")


def test_oversized_record_is_refused():
    scenarios.oversized_record_is_refused(MemoryTransport(max_record_bytes=50_000), "t", 50_000)


def test_group_members_share_partitions_and_resume_at_commits():
    transport = MemoryTransport(partitions=2)
    topic = scenarios.new_topic(transport, "t.tasks")
    sink = transport.sink()
    for i in range(10):
        sink.send(topic, b"v", key=f"k{i}", partition=i % 2)
    a = transport.source(group="g", topics=[topic])
    assert len(scenarios.poll_until(a, 10)) == 10 and a.assignment() == {f"{topic}:0", f"{topic}:1"}
    a.commit({f"{topic}:0": 5, f"{topic}:1": 3})  # partition 1: two records read but not committed
    b = transport.source(group="g", topics=[topic])
    assert a.assignment() == {f"{topic}:0"} and b.assignment() == {f"{topic}:1"}
    again = b.poll(timeout_s=0)
    assert [(m.partition, m.offset) for m in again] == [(1, 3), (1, 4)]  # at-least-once: redelivered
    b.close()
    assert a.assignment() == {f"{topic}:0", f"{topic}:1"} and a.positions()[f"{topic}:1"] == 3
    assert transport.admin().group_offsets("g") == {f"{topic}:0": 5, f"{topic}:1": 3}


def test_a_new_group_starts_at_the_beginning_or_the_end():
    transport = MemoryTransport(partitions=1)
    topic = scenarios.new_topic(transport, "t.tasks")
    transport.sink().send(topic, b"old")
    latest = transport.source(group="late", topics=[topic], from_beginning=False)
    earliest = transport.source(group="early", topics=[topic])
    assert latest.poll(timeout_s=0) == []
    transport.sink().send(topic, b"new")
    assert [m.value for m in latest.poll(timeout_s=0)] == [b"new"]
    assert [m.value for m in earliest.poll(timeout_s=0)] == [b"old", b"new"]


def test_retention_and_fetch():
    transport = MemoryTransport(partitions=1)
    topic = scenarios.new_topic(transport, "t.experiences")
    sink = transport.sink()
    for i in range(5):
        sink.send(topic, str(i).encode())
    transport.truncate(f"{topic}:0", 2)
    source = transport.source()
    assert source.beginning_offsets(topic) == {f"{topic}:0": 2} and source.end_offsets(topic) == {f"{topic}:0": 5}
    assert source.fetch(f"{topic}:0", 1) is None  # deleted by retention
    assert source.fetch(f"{topic}:0", 3).value == b"3"
    with pytest.raises(TransportError, match="past the partition's end"):
        source.fetch(f"{topic}:0", 5)
    assert [m.offset for m in source.read_range(topic)] == [2, 3, 4]


def test_unknown_topics_and_group_rules():
    transport = MemoryTransport()
    with pytest.raises(TransportError, match="does not exist"):
        transport.sink().send("nope", b"x")
    with pytest.raises(TransportError, match="needs a consumer group"):
        transport.source(topics=["nope"])
    group_source = transport.source(group="g", topics=[scenarios.new_topic(transport, "t.x")])
    with pytest.raises(TransportError, match="without a consumer group"):
        list(group_source.read_range("t.x"))


def test_positions_values():
    key = offset_key("run.experiences", 3)
    assert isinstance(key, Position) and key == "run.experiences:3"
    assert (key.topic, key.partition) == ("run.experiences", 3)
    assert parse_offset_key("a:b.c:0").topic == "a:b.c"
    with pytest.raises(ValueError):
        parse_offset_key("no-partition")
    assert parse_positions(["0:100", "1:250"], "t", "--from-offset", 2) == {"t:0": 100, "t:1": 250}
    with pytest.raises(ValueError, match="has partitions 0..1"):
        parse_positions(["2:1"], "t", "--from-offset", 2)
    assert parse_time_ms("2025-01-31T12:00:00Z", "x") == parse_time_ms("2025-01-31T12:00:00", "x") == 1738324800000
    assert lag({"t:0": 10, "t:1": 5}, {"t:0": 4}) == 11 and lag({"t:0": 10, "t:1": 5}, {"t:0": 4}, ["t:1"]) == 5


