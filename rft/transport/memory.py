"""In-memory implementations of rft.transport's protocols, for unit tests of the trainer and explorer loops.

`MemoryTransport()` holds one process-local "broker" (topics of partitions of records) and builds `MemorySink`,
`MemorySource` and `MemoryAdmin` on it with the same methods as `rft.transport.kafka.KafkaTransport`. It keeps
the protocols' contract where a test can observe it: offsets, keys (same key, same partition), headers,
timestamps, the size limit, consumer groups with committed offsets, seek, beginning/end offsets, offsets by
time, replay by range and fetch. A send is durable at once (its future is already done).

What it does not model: other processes, network failures, rebalance delays, compaction. Consumer groups use a
trivial assignment: the partitions of the subscribed topics are dealt round-robin over the members in join
order, and re-dealt when a member joins or closes. `truncate()` drops a partition's head (retention) for tests
of `fetch`. Thread-safe (one lock); a source, as the protocol says, is used from one thread.
"""
from __future__ import annotations

import threading
import time
import zlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from rft.transport.base import (
    Message,
    PartitionInfo,
    RecordMetadata,
    SinkBase,
    SourceBase,
    TransportError,
    offset_key,
    parse_offset_key,
)
from rft.transport.claims import ClaimStore

MAX_POLL_RECORDS = 500  # kafka-python's default max_poll_records


@dataclass
class _Group:
    members: list[MemorySource] = field(default_factory=list)  # in join order
    committed: dict[str, int] = field(default_factory=dict)


class _Broker:
    """Topics, partitions and groups shared by every client of one MemoryTransport."""

    def __init__(self, partitions: int):
        self.default_partitions = partitions
        self.logs: dict[str, list[list[Message]]] = {}  # topic -> partition -> records (from `starts`)
        self.starts: dict[str, int] = {}  # "topic:partition" -> offset of the first record still held
        self.groups: dict[str, _Group] = {}
        self.changed = threading.Condition()  # its lock guards everything here; notified on every append
        self._round_robin = 0

    def partitions(self, topic: str) -> list[list[Message]]:
        if topic not in self.logs:
            raise TransportError(f"topic {topic!r} does not exist (or has no partitions)")
        return self.logs[topic]

    def beginning(self, key: str) -> int:
        return self.starts.get(key, 0)

    def end(self, key: str) -> int:
        position = parse_offset_key(key)
        return self.beginning(key) + len(self.partitions(position.topic)[position.partition])

    def record(self, key: str, offset: int) -> Message | None:
        position = parse_offset_key(key)
        index = offset - self.beginning(key)
        records = self.partitions(position.topic)[position.partition]
        return records[index] if 0 <= index < len(records) else None

    def held(self, key: str, offset: int) -> Message:
        """The record at `offset`, which the caller knows is held (beginning <= offset < end, under the lock)."""
        m = self.record(key, offset)
        assert m is not None, f"{key}@{offset} is not held"
        return m

    def pick_partition(self, topic: str, key: bytes | None) -> int:
        count = len(self.partitions(topic))
        if key is not None:
            return zlib.crc32(key) % count
        self._round_robin += 1
        return self._round_robin % count

    def append(self, topic: str, partition: int, message: Callable[[int], Message]) -> Message:
        records = self.partitions(topic)[partition]
        m = message(self.end(offset_key(topic, partition)))
        records.append(m)
        self.changed.notify_all()
        return m

    def deal(self, group: str) -> None:
        """Share the subscribed partitions round-robin over the members, in join order. A member that loses a
        partition forgets its position there: whoever takes it starts at the group's committed offset."""
        members = self.groups[group].members
        keys: list[str] = sorted({k for member in members for t in member.subscription if t in self.logs
                       for k in (offset_key(t, p) for p in range(len(self.logs[t])))})
        for i, member in enumerate(members):
            member._assigned = keys[i::len(members)]
            member._positions = {k: v for k, v in member._positions.items() if k in member._assigned}


class MemoryFuture:
    """A send that is already durable (rft.transport.SendFuture)."""

    def __init__(self, meta: RecordMetadata):
        self.meta = meta

    def get(self, timeout: float | None = None) -> RecordMetadata:
        return self.meta

    def add_errback(self, callback: Callable[[BaseException], Any]) -> None:
        pass  # an in-memory send does not fail after it returned


class MemorySink(SinkBase):
    """rft.transport.RecordSink in memory: records are appended at once."""

    def __init__(self, broker: _Broker, *, limit: int, claims: ClaimStore | None = None):
        self._broker, self.limit, self.claims = broker, limit, claims

    def send(self, topic: str, value: bytes, *, key: bytes | str | None = None,
             headers: list[tuple[str, bytes]] | None = None, partition: int | None = None,
             timestamp_ms: int | None = None, check_size: bool = True) -> MemoryFuture:
        key_bytes = self._checked_key(topic, value, key, headers, check_size)
        stamp = int(time.time() * 1000) if timestamp_ms is None else timestamp_ms
        with self._broker.changed:
            p = self._broker.pick_partition(topic, key_bytes) if partition is None else partition
            if not 0 <= p < len(self._broker.partitions(topic)):
                raise TransportError(f"topic {topic!r} has no partition {p}")
            m = self._broker.append(topic, p, lambda offset: Message(topic, p, offset, key_bytes, value,
                                                                     list(headers or []), stamp))
        return MemoryFuture(RecordMetadata(topic, p, m.offset, stamp))

    def flush(self, timeout_s: float | None = None) -> None:
        pass

    def close(self) -> None:
        pass


class MemorySource(SourceBase):
    """rft.transport.RecordSource in memory. With a group: subscribed to `topics`, sharing their partitions
    with the group's other members (see the module docstring)."""

    joined = True  # a member is dealt its partitions when it subscribes

    def __init__(self, broker: _Broker, *, group: str | None = None, topics: Iterable[str] = (),
                 from_beginning: bool = True):
        self._broker, self.group = broker, group
        self._from_beginning = from_beginning
        self._assigned: list[str] = []
        self._positions: dict[str, int] = {}
        self.subscription = list(topics)
        if self.subscription:
            if group is None:
                raise TransportError("subscribing to topics needs a consumer group; use assign() without one")
            with broker.changed:
                broker.groups.setdefault(group, _Group()).members.append(self)
                broker.deal(group)

    # -- reading
    def poll(self, timeout_s: float = 1.0, max_records: int | None = None) -> list[Message]:
        """Records after the positions, in (topic, partition, offset) order; waits up to `timeout_s` for one."""
        deadline = time.monotonic() + timeout_s
        with self._broker.changed:
            while True:
                out = self._take(max_records or MAX_POLL_RECORDS)
                left = deadline - time.monotonic()
                if out or left <= 0:
                    return out
                self._broker.changed.wait(left)

    def _take(self, limit: int) -> list[Message]:
        if self.group is not None and self.subscription:
            self._broker.deal(self.group)
        out: list[Message] = []
        for key in sorted(self._assigned):
            offset = max(self._position(key), self._broker.beginning(key))
            while len(out) < limit and (m := self._broker.record(key, offset)) is not None:
                out.append(m)
                offset += 1
            self._positions[key] = offset
        return sorted(out, key=lambda m: (m.topic, m.partition, m.offset))

    def _position(self, key: str) -> int:
        if key not in self._positions:
            committed = self._broker.groups.get(self.group, _Group()).committed.get(key) if self.group else None
            if committed is not None:
                self._positions[key] = committed
            else:
                self._positions[key] = self._broker.beginning(key) if self._from_beginning else self._broker.end(key)
        return self._positions[key]

    # -- positions
    def partitions(self, topic: str) -> list[str]:
        with self._broker.changed:
            return [offset_key(topic, p) for p in range(len(self._broker.partitions(topic)))]

    def assign(self, topics: Iterable[str]) -> list[str]:
        keys = [k for t in topics for k in self.partitions(t)]
        self._assigned = list(keys)
        return keys

    def assignment(self) -> set[str]:
        with self._broker.changed:
            if self.group is not None and self.subscription:
                self._broker.deal(self.group)
            return {parse_offset_key(k) for k in self._assigned}

    def seek(self, offsets: dict[str, int]) -> None:
        for key, offset in offsets.items():
            if self.group is None and key not in self._assigned:
                self._assigned.append(key)
            self._positions[key] = offset

    def seek_to_beginning(self) -> None:
        with self._broker.changed:
            self._positions.update({k: self._broker.beginning(k) for k in self._assigned})

    def positions(self) -> dict[str, int]:
        with self._broker.changed:
            return {k: self._position(k) for k in self._assigned}

    def commit(self, offsets: dict[str, int] | None = None) -> None:
        if self.group is None:
            raise TransportError("commit needs a consumer group")
        with self._broker.changed:
            self._broker.groups.setdefault(self.group, _Group()).committed.update(
                self.positions() if offsets is None else offsets)

    def committed(self, topic: str) -> dict[str, int | None]:
        with self._broker.changed:
            committed = self._broker.groups.get(self.group, _Group()).committed if self.group else {}
            return {k: committed.get(k) for k in self.partitions(topic)}

    def beginning_offsets(self, topic: str) -> dict[str, int]:
        with self._broker.changed:
            return {k: self._broker.beginning(k) for k in self.partitions(topic)}

    def end_offsets(self, topic: str) -> dict[str, int]:
        with self._broker.changed:
            return {k: self._broker.end(k) for k in self.partitions(topic)}

    def offsets_for_time(self, topic: str, timestamp_ms: int) -> dict[str, int]:
        """First offset stamped at or after `timestamp_ms` per partition (the end offset when none is)."""
        with self._broker.changed:
            out = {}
            for key in self.partitions(topic):
                offset, end = self._broker.beginning(key), self._broker.end(key)
                while offset < end and self._broker.held(key, offset).timestamp_ms < timestamp_ms:
                    offset += 1
                out[key] = offset
            return out

    def read_offsets(self, begin: dict[str, int], stop: dict[str, int], *, from_time_ms: int | None = None,
                     to_time_ms: int | None = None, idle_timeout_s: float = 10.0) -> Iterator[Message]:
        if self.group is not None:
            raise TransportError("read_range / read_offsets need a source without a consumer group")
        pending = sorted(k for k in begin if begin[k] < stop.get(k, 0))
        self._assigned = list(pending)
        self.seek({k: begin[k] for k in pending})
        for key in pending:
            with self._broker.changed:
                records = [self._broker.held(key, o) for o in range(max(begin[key], self._broker.beginning(key)),
                                                                      min(stop[key], self._broker.end(key)))]
            self._positions[key] = stop[key]
            yield from (m for m in records if (from_time_ms is None or m.timestamp_ms >= from_time_ms)
                        and (to_time_ms is None or m.timestamp_ms < to_time_ms))

    def fetch(self, position: str, offset: int, *, idle_timeout_s: float = 10.0) -> Message | None:
        if self.group is not None:
            raise TransportError("fetch needs a source without a consumer group")
        with self._broker.changed:
            if offset >= self._broker.end(position):
                raise TransportError(f"fetch {position}@{offset}: past the partition's end")
            self._assigned, self._positions[position] = [position], offset + 1
            return self._broker.record(position, offset)

    def close(self) -> None:
        if self.group is not None and self.subscription:
            with self._broker.changed:
                self._broker.groups[self.group].members.remove(self)
                if self._broker.groups[self.group].members:
                    self._broker.deal(self.group)


class MemoryAdmin:
    """rft.transport.Admin in memory."""

    def __init__(self, broker: _Broker):
        self._broker = broker

    def create_topics(self, names: Iterable[str], partitions: int | None = None) -> list[str]:
        with self._broker.changed:
            wanted = [n for n in names if n not in self._broker.logs]
            for name in wanted:
                self._broker.logs[name] = [[] for _ in range(partitions or self._broker.default_partitions)]
            return wanted

    def list_topics(self) -> list[str]:
        with self._broker.changed:
            return sorted(t for t in self._broker.logs if not t.startswith("__"))

    def describe(self, topic: str) -> list[PartitionInfo]:
        with self._broker.changed:
            keys = [offset_key(topic, p) for p in range(len(self._broker.partitions(topic)))]
            return [PartitionInfo(k.partition, self._broker.beginning(k), self._broker.end(k)) for k in keys]

    def groups(self) -> list[str]:
        with self._broker.changed:
            return sorted(self._broker.groups)

    def group_offsets(self, group: str) -> dict[str, int]:
        with self._broker.changed:
            return dict(self._broker.groups[group].committed) if group in self._broker.groups else {}

    def delete_topics(self, names: Iterable[str]) -> None:
        names = list(names)
        with self._broker.changed:
            for name in names:
                if name not in self._broker.logs:
                    raise TransportError(f"deleting topics {names} failed: no topic {name!r}")
                del self._broker.logs[name]
                self._broker.starts = {k: v for k, v in self._broker.starts.items()
                                       if parse_offset_key(k).topic != name}

    def close(self) -> None:
        pass


class MemoryTransport:
    """rft.transport.Transport in memory: every client it builds shares one broker. `partitions` is the default
    partition count of a new topic (kafka.partitions), `max_record_bytes` the sinks' limit, `claims` the claim store
    (rft.transport.Transport)."""

    def __init__(self, *, partitions: int = 2, max_record_bytes: int = 1_000_000, claims: ClaimStore | None = None):
        self.broker = _Broker(partitions)
        self.max_record_bytes, self.claims = max_record_bytes, claims

    def sink(self, *, client_id: str = "rft", linger_ms: int = 5) -> MemorySink:
        return MemorySink(self.broker, limit=self.max_record_bytes, claims=self.claims)

    def source(self, *, group: str | None = None, topics: Iterable[str] = (), client_id: str = "rft",
               from_beginning: bool = True, group_instance_id: str | None = None,
               max_poll_interval_ms: int | None = None) -> MemorySource:
        return MemorySource(self.broker, group=group, topics=topics, from_beginning=from_beginning)

    def admin(self) -> MemoryAdmin:
        return MemoryAdmin(self.broker)

    def truncate(self, position: str, before: int) -> None:
        """Drop the records of `position` before offset `before` (what retention does)."""
        with self.broker.changed:
            key = parse_offset_key(position)
            records = self.broker.partitions(key.topic)[key.partition]
            drop = max(0, min(before, self.broker.end(key)) - self.broker.beginning(key))
            del records[:drop]
            self.broker.starts[key] = self.broker.beginning(key) + drop
