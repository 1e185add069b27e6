"""Transport scenarios written once against the `rft.transport.Transport` protocol, run on the in-memory
transport by tests/unit/test_transport_memory.py and on the real broker by
tests/integration/test_transport_fidelity.py, so that the fake is held to what Kafka does. Each takes a
transport whose new topics have 2 partitions and a unique topic prefix."""
from __future__ import annotations

import pytest

from rft.schema import HEADER_ERROR, decode_group, encode
from rft.transport import HEADER_ORIGIN, DeadLetter, Message, RecordMetadata, RecordTooLarge, Transport, offset_key
from tests.records import make_group
from tests.waiting import wait_until

T0 = 1_700_000_000_000


def new_topic(transport: Transport, name: str, partitions: int | None = None) -> str:
    admin = transport.admin()
    admin.create_topics([name], partitions=partitions)
    admin.close()
    return name


def read_all(transport: Transport, topic: str, **bounds) -> list[Message]:
    source = transport.source()
    try:
        return list(source.read_range(topic, **bounds))
    finally:
        source.close()


def poll_until(source, count: int, timeout_s: float = 30.0, max_records: int | None = None) -> list[Message]:
    """Poll `source` until it has returned at least `count` records; all it returned (fails if fewer came in
    `timeout_s`)."""
    out: list[Message] = []

    def poll() -> None:
        out.extend(source.poll(timeout_s=0.5, max_records=None if max_records is None else max_records - len(out)))

    wait_until(lambda: len(out) >= count, timeout=timeout_s, what=f"{count} records", between=poll)
    return out


def round_trip(transport: Transport, prefix: str) -> None:
    """Keyed records spread over both partitions; the same key lands in the same partition; end offsets count."""
    topic = new_topic(transport, f"{prefix}.experiences")
    groups = [make_group("run", i) for i in range(20)]
    sink = transport.sink()
    futures = [sink.send_record(topic, g, key=g.group_id) for g in groups]
    sink.flush()
    metas = [f.get(timeout=10) for f in futures]
    again = sink.send_record(topic, groups[0], key=groups[0].group_id).get(timeout=10)
    sink.close()
    assert all(isinstance(m, RecordMetadata) and m.topic == topic for m in metas)
    assert again.partition == metas[0].partition and again.offset > metas[0].offset
    messages = read_all(transport, topic)
    got = {m.key.decode(): decode_group(m.value, m.headers) for m in messages}
    assert len(messages) == 21 and got == {g.group_id: g for g in groups}
    assert {m.partition for m in messages} == {0, 1}
    source = transport.source()
    assert source.end_offsets(topic) == {offset_key(topic, p): sum(m.partition == p for m in messages) for p in (0, 1)}
    assert source.beginning_offsets(topic) == {offset_key(topic, 0): 0, offset_key(topic, 1): 0}
    source.close()


def positions_are_strings(transport: Transport, prefix: str) -> None:
    """Partitions, assignments and positions are "topic:partition" strings; seek and positions round-trip."""
    topic = new_topic(transport, f"{prefix}.experiences")
    sink = transport.sink()
    for i in range(6):
        sink.send(topic, f"v{i}".encode(), key=f"k{i}", partition=i % 2)
    sink.flush()
    sink.close()
    source = transport.source()
    keys = [f"{topic}:0", f"{topic}:1"]
    assert source.partitions(topic) == keys and all(isinstance(k, str) for k in source.partitions(topic))
    assert source.assign([topic]) == keys
    assert source.assignment() == set(keys)
    assert {k.partition for k in source.assignment()} == {0, 1}
    source.seek({f"{topic}:0": 1, f"{topic}:1": 2})
    got = poll_until(source, 3)
    assert sorted((m.partition, m.offset) for m in got) == [(0, 1), (0, 2), (1, 2)]
    assert source.positions() == {f"{topic}:0": 3, f"{topic}:1": 3}
    fetched = source.fetch(f"{topic}:1", 1)
    assert fetched is not None and fetched.value == b"v3" and fetched.position == f"{topic}:1"
    source.close()


def commits_survive_a_consumer_restart(transport: Transport, prefix: str) -> None:
    """A group member that commits and leaves; the next one resumes each partition at its committed offset."""
    topic = new_topic(transport, f"{prefix}.experiences")
    groups = [make_group("run", i) for i in range(12)]
    sink = transport.sink()
    for g in groups:
        sink.send_record(topic, g, key=g.group_id)
    sink.flush()
    sink.close()
    group = f"{prefix}-trainer"
    before = transport.source(group=group, topics=[topic])
    first = poll_until(before, 5, max_records=5)
    before.commit()
    positions = before.positions()
    before.close()
    assert len(first) == 5
    after = transport.source(group=group, topics=[topic])
    rest = poll_until(after, 7)
    assert after.committed(topic) == positions
    after.close()
    assert sorted(m.key.decode() for m in first + rest) == sorted(g.group_id for g in groups)
    for m in rest:
        assert m.offset >= positions[m.position]


def replay_by_offset_range_and_time_range(transport: Transport, prefix: str) -> None:
    topic = new_topic(transport, f"{prefix}.experiences")
    sink = transport.sink()
    for i in range(20):  # partition i % 2, offset i // 2, time T0 + i seconds
        value, headers = encode(make_group("run", i))
        sink.send(topic, value, key=f"g{i}", headers=headers, partition=i % 2, timestamp_ms=T0 + 1000 * i)
    sink.flush()
    sink.close()

    def keys(**bounds):
        return sorted(int(m.key.decode()[1:]) for m in read_all(transport, topic, **bounds))

    assert keys() == list(range(20))
    assert keys(start={f"{topic}:0": 3}, end={f"{topic}:0": 6, f"{topic}:1": 2}) == [1, 3, 6, 8, 10]
    assert keys(from_time_ms=T0 + 5000, to_time_ms=T0 + 9000) == [5, 6, 7, 8]
    assert keys(from_time_ms=T0 + 4500, to_time_ms=T0 + 6001) == [5, 6]
    assert keys(from_time_ms=T0 + 60_000) == []
    assert keys(start={f"{topic}:1": 8}, from_time_ms=T0 + 10_000) == [10, 12, 14, 16, 17, 18, 19]


def dead_letters_keep_bytes_and_reason(transport: Transport, prefix: str) -> None:
    topic = new_topic(transport, f"{prefix}.experiences", partitions=1)
    dlq = new_topic(transport, f"{prefix}.dead_letter", partitions=1)
    good = make_group("run", 1)
    sink = transport.sink()
    sink.send(topic, b"\x00\xffnot msgpack", key="bad", headers=[("rft-schema", b"1"), ("x", b"y")])
    sink.send_record(topic, good, key=good.group_id)
    sink.flush()
    source = transport.source()
    source.seek({f"{topic}:0": 0})
    dead = DeadLetter(sink, dlq)
    decoded = [g for _, g in dead.decode(poll_until(source, 2), decode_group)]
    source.close()
    sink.flush()
    sink.close()
    assert decoded == [good] and dead.count == 1
    [m] = read_all(transport, dlq)
    assert m.key == b"bad" and m.value == b"\x00\xffnot msgpack"
    assert "not msgpack" in dict(m.headers)[HEADER_ERROR].decode()
    assert dict(m.headers)[HEADER_ORIGIN] == f"{topic}:0@0".encode()
    assert [h for h in m.headers if h[0] not in (HEADER_ERROR, HEADER_ORIGIN)] == [("rft-schema", b"1"), ("x", b"y")]


def oversized_record_is_refused(transport: Transport, prefix: str, limit: int) -> None:
    """`transport`'s sinks have a limit of `limit` bytes."""
    topic = new_topic(transport, f"{prefix}.experiences", partitions=1)
    value = b"x" * (limit + 1)
    sink = transport.sink()
    with pytest.raises(RecordTooLarge, match=rf"is {limit + 4} bytes, over the limit of {limit} bytes"):
        sink.send(topic, value, key="big")
    sink.send(topic, b"small", key="ok").get(timeout=10)
    sink.close()
    assert [m.key for m in read_all(transport, topic)] == [b"ok"]


SCENARIOS = [round_trip, positions_are_strings, commits_survive_a_consumer_restart,
             replay_by_offset_range_and_time_range, dead_letters_keep_bytes_and_reason]
