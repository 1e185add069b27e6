"""The protocols and plain values of rft.transport (see the package docstring): what every implementation and
every caller shares. Imports no Kafka."""
from __future__ import annotations

import dataclasses
import logging
import socket
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, Protocol

from rft.schema import HEADER_ERROR, RecordError, encode
from rft.transport.claims import HEADER_CLAIMS, ClaimStore, ClaimStoreError, check_in, check_out, claims_in

log = logging.getLogger(__name__)

HEADER_ORIGIN = "rft-origin"
HEADER_OMITTED = "rft-omitted-bytes"  # on a dead letter whose value was too large to copy: the value's size


class TransportError(RuntimeError):
    """The transport failed (no broker, a wedged client, a send the broker refused). Callers that keep their
    own positions reconnect and seek; others let it propagate."""


class BrokerUnreachable(TransportError):
    """No broker accepts a connection at the bootstrap address (`probe_bootstrap`): a wrong address or port, a
    broker that is down, a firewall. Commands report it in one line (rft.cli: exit status 4)."""


def probe_bootstrap(bootstrap: str, timeout_s: float = 3.0) -> None:
    """Return once one of the comma-separated `host:port` servers of `bootstrap` accepts a TCP connection (each
    tried for at most `timeout_s`); BrokerUnreachable naming the address and each server's error otherwise. A
    plain connect, so an unreachable broker is reported in seconds, not after a client's own wait."""
    errors = []
    for server in (s.strip() for s in bootstrap.split(",") if s.strip()):
        host, _, port = server.rpartition("://")[2].rpartition(":")  # PLAINTEXT://host:port is kafka-python's too
        host = host.strip("[]")
        if not host or not port.isdigit():
            errors.append(f"{server}: not host:port")
            continue
        try:
            socket.create_connection((host, int(port)), timeout=timeout_s).close()
            return
        except OSError as e:
            errors.append(f"{server}: {e.strerror or e}")
    raise BrokerUnreachable(f"cannot reach the Kafka broker at {bootstrap} ({'; '.join(errors) or 'no address'}); "
                            "check kafka.bootstrap_servers and that the broker is up")


class RecordTooLarge(TransportError):
    """A record over the sink's limit; refused before it was sent, with its size and the limit."""


class ClaimStoreUnavailable(TransportError):
    """`send_record` could not store a claim-checked part (the claim store failed past its retries): the record was
    not sent, so no claim without its object is ever on a topic."""


class PositionSpecError(ValueError):
    """A malformed offset or time given by a user (`P:O`, ISO 8601)."""


# --------------------------------------------------------------------------------------------------
# Values


class Position(str):
    """A partition of a topic as the string `"topic:partition"` (a dict key of every offset map), with its
    parts. Equal to, and hashed as, the plain string."""

    @property
    def topic(self) -> str:
        return self.rpartition(":")[0]

    @property
    def partition(self) -> int:  # type: ignore[override]  # deliberate: a Position is never split as a str
        return int(self.rpartition(":")[2])


def offset_key(topic: str, partition: int) -> Position:
    return Position(f"{topic}:{partition}")


def parse_offset_key(key: str) -> Position:
    """`"topic:partition"` as a Position; ValueError when it is not of that form."""
    topic, sep, partition = key.rpartition(":")
    if not sep or not topic or not partition.isdigit():
        raise ValueError(f"expected TOPIC:PARTITION, got {key!r}")
    return Position(key)


@dataclass(frozen=True)
class Message:
    """One record as read: raw bytes (never decoded here), its position and the producer's timestamp (ms)."""
    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes
    headers: list[tuple[str, bytes]]
    timestamp_ms: int

    @property
    def position(self) -> Position:
        return offset_key(self.topic, self.partition)


@dataclass(frozen=True)
class RecordMetadata:
    """Where a sent record landed (what `SendFuture.get` returns)."""
    topic: str
    partition: int
    offset: int
    timestamp_ms: int

    @property
    def position(self) -> Position:
        return offset_key(self.topic, self.partition)


@dataclass
class PartitionInfo:
    partition: int
    beginning: int
    end: int


def lag(end: dict[str, int], consumed: dict[str, int], partitions: Iterable[str] | None = None) -> int:
    """Records between `consumed` and `end` ("topic:partition" -> offset), over `partitions` (default: all of end)."""
    keys = end if partitions is None else [k for k in partitions if k in end]
    return sum(max(0, end[k] - consumed.get(k, 0)) for k in keys)


def record_size(value: bytes | None, key: bytes | None, headers: list[tuple[str, bytes]] | None) -> int:
    """Bytes a sink counts against its limit: value, key, header names and values."""
    return len(value or b"") + len(key or b"") + sum(len(k) + len(v or b"") for k, v in headers or [])


def parse_positions(specs: list[str], topic: str, option: str, partitions: int) -> dict[str, int]:
    """`["0:100", "1:250"]` -> {"topic:0": 100, "topic:1": 250}; PositionSpecError naming `option` otherwise."""
    out: dict[str, int] = {}
    for spec in specs:
        partition, sep, offset = spec.partition(":")
        if not sep or not partition.isdigit() or not offset.isdigit():
            raise PositionSpecError(f"{option} expects PARTITION:OFFSET (e.g. 0:100), got {spec!r}")
        if int(partition) >= partitions:
            raise PositionSpecError(f"{option} {spec}: topic {topic!r} has partitions 0..{partitions - 1}")
        out[offset_key(topic, int(partition))] = int(offset)
    return out


def parse_time_ms(text: str | None, option: str) -> int | None:
    """Milliseconds since the epoch, or ISO 8601 (a time without a zone is UTC); None stays None."""
    if text is None:
        return None
    if text.isdigit():
        return int(text)
    try:
        moment = datetime.fromisoformat(text)
    except ValueError:
        raise PositionSpecError(f"{option} expects ISO 8601 (e.g. 2025-01-31T12:00:00Z) or milliseconds since "
                                f"the epoch, got {text!r}") from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=timezone.utc)
    return int(moment.timestamp() * 1000)


# --------------------------------------------------------------------------------------------------
# Protocols


class SendFuture(Protocol):
    """The pending result of one `send`."""

    def get(self, timeout: float | None = None) -> RecordMetadata:
        """Wait until the record is durable and return where it landed; TransportError if the broker refused it
        (or did not answer within `timeout` seconds)."""

    def add_errback(self, callback: Callable[[BaseException], Any]) -> None:
        """Call `callback(error)` if the send fails (from the sink's IO thread)."""


class RecordSink(Protocol):
    """Produces records.

    Delivery: `send()` is asynchronous; a record is durable once `flush()` returns or its future's `get()`
    returns (acks from all in-sync replicas, idempotent producer: a retried send is written once). A record
    whose `record_size` is over `limit` (kafka.max_record_bytes) is refused before it is sent with
    RecordTooLarge naming its size and the limit, unless `check_size=False` (records that already exist: dead
    letters, imports; never lose them). Records sent with the same key go to the same partition, in send order.
    A sink with a claim store (`claims`) claim-checks what `send_record` sends (rft/transport/claims.py): its parts
    over the store's threshold, else its whole body when still over `limit`. Thread-safe."""
    limit: int
    claims: ClaimStore | None


    def send(self, topic: str, value: bytes, *, key: bytes | str | None = None,
             headers: list[tuple[str, bytes]] | None = None, partition: int | None = None,
             timestamp_ms: int | None = None, check_size: bool = True) -> SendFuture: ...

    def send_record(self, topic: str, record: Any, *, key: str | None = None) -> SendFuture:
        """Encode an rft record (rft.schema) and send it."""

    def flush(self, timeout_s: float | None = None) -> None: ...

    def close(self) -> None: ...


class RecordSource(Protocol):
    """Consumes raw records (bytes; decoding is the caller's, see `DeadLetter`).

    Delivery: commits are manual (`commit()`), so delivery is at-least-once: records polled after the last
    commit are delivered again to whoever takes the partition next. Exactly-once is the caller's: store the
    positions with your own state and `seek()` to them on restart (what the trainer's feed does).
    - `group` set: joins a consumer group subscribed to `topics`; the group's partitions are shared among its
      members, each starting at the group's committed offset (else the beginning or the end, `from_beginning`).
    - `group` None: partitions are taken explicitly with `assign()` / `seek()`; replay by offsets or time with
      `read_range` / `read_offsets` / `fetch`.
    `poll()` returns each partition's records in offset order, sorted by (topic, partition, offset).
    Not thread-safe: use a source from one thread."""
    group: str | None


    def poll(self, timeout_s: float = 1.0, max_records: int | None = None) -> list[Message]: ...

    def partitions(self, topic: str) -> list[str]:
        """The topic's partitions as "topic:partition", in partition order; TransportError if it does not exist."""

    def assign(self, topics: Iterable[str]) -> list[str]:
        """Take every partition of `topics` (no group); returns them."""

    def assignment(self) -> set[str]:
        """The partitions this source reads now (with a group: what the group gave it)."""

    @property
    def joined(self) -> bool:
        """With a group: True once the group has answered this member's first join with an assignment (possibly
        empty); before that it cannot tell whether it will have records. A Kafka consumer joins in its first polls,
        and Tansu answers a JoinGroup only after seconds (docs/benchmarks.md). Without a group: True."""

    def seek(self, offsets: dict[str, int]) -> None:
        """Position at stored offsets ("topic:partition" -> next offset); assigns them if unassigned."""

    def seek_to_beginning(self) -> None: ...

    def positions(self) -> dict[str, int]:
        """Next offset to read of each assigned partition."""

    def commit(self, offsets: dict[str, int] | None = None) -> None:
        """Commit to the group: the given offsets, or the current positions."""

    def committed(self, topic: str) -> dict[str, int | None]:
        """The group's committed offset per partition of `topic` (None where nothing was committed)."""

    def beginning_offsets(self, topic: str) -> dict[str, int]: ...

    def end_offsets(self, topic: str) -> dict[str, int]:
        """One past the last record of each partition."""

    def offsets_for_time(self, topic: str, timestamp_ms: int) -> dict[str, int]:
        """First offset at or after `timestamp_ms` per partition (the end offset when none is): a starting point
        as the broker answers it, not a filter."""

    def replay_bounds(self, topic: str, *, start: dict[str, int] | None = None, end: dict[str, int] | None = None,
                      from_time_ms: int | None = None) -> tuple[dict[str, int], dict[str, int]]: ...

    def read_range(self, topic: str, *, start: dict[str, int] | None = None, end: dict[str, int] | None = None,
                   from_time_ms: int | None = None, to_time_ms: int | None = None,
                   idle_timeout_s: float = 10.0) -> Iterator[Message]: ...

    def read_offsets(self, begin: dict[str, int], stop: dict[str, int], *, from_time_ms: int | None = None,
                     to_time_ms: int | None = None, idle_timeout_s: float = 10.0) -> Iterator[Message]:
        """The records in `[begin, stop)` of each partition named in `begin`, only those stamped in
        `[from_time_ms, to_time_ms)` when given. No group; leaves the source assigned to those partitions."""

    def fetch(self, position: str, offset: int, *, idle_timeout_s: float = 10.0) -> Message | None:
        """The record at `offset` of `position`; None when the partition no longer holds it (retention)."""

    def close(self) -> None: ...


class Admin(Protocol):
    """Topic administration and description."""

    def create_topics(self, names: Iterable[str], partitions: int | None = None) -> list[str]:
        """Create missing topics (default partitions: kafka.partitions); returns those created."""

    def list_topics(self) -> list[str]:
        """Topic names, sorted, without internal ("__") topics."""

    def describe(self, topic: str) -> list[PartitionInfo]: ...

    def groups(self) -> list[str]: ...

    def group_offsets(self, group: str) -> dict[str, int]: ...

    def delete_topics(self, names: Iterable[str]) -> None: ...

    def close(self) -> None: ...


class Transport(Protocol):
    """Builds the clients of one process; one per process, passed down (a test passes a MemoryTransport). `claims`:
    the run's claim store (None: records are sent whole and a record with claims cannot be read); its sinks
    claim-check what they send, its readers resolve with `resolve_claims(message, transport.claims)`."""
    claims: ClaimStore | None

    def sink(self, *, client_id: str = "rft", linger_ms: int = 5) -> RecordSink: ...

    def source(self, *, group: str | None = None, topics: Iterable[str] = (), client_id: str = "rft",
               from_beginning: bool = True, group_instance_id: str | None = None,
               max_poll_interval_ms: int | None = None) -> RecordSource:
        """`max_poll_interval_ms`: how long a group member may go between polls before the group presumes it
        dead (None: kafka.max_poll_interval_ms)."""

    def admin(self) -> Admin: ...


# --------------------------------------------------------------------------------------------------
# What every implementation shares, written once over the protocols' primitives


class SinkBase:
    """`send_record` (with the claim-check when the sink has a claim store) and the size check, over an
    implementation's `send` and `limit`."""
    limit: int
    claims: ClaimStore | None = None

    def send_record(self: RecordSink, topic: str, record: Any, *, key: str | None = None) -> SendFuture:
        value, headers = encode(record)
        if self.claims is not None and self.claims.threshold > 0:
            count_header = len(HEADER_CLAIMS) + 10  # room for the header the claims add
            room = self.limit - record_size(None, key.encode() if key else None, headers) - count_header
            try:
                checked = check_out(value, self.claims, threshold=self.claims.threshold, limit=room)
            except ClaimStoreError as e:
                raise ClaimStoreUnavailable(f"record for topic {topic!r} not sent: {e}") from e
            if checked is not value:
                value, headers = checked, [*headers, (HEADER_CLAIMS, str(len(claims_in(checked))).encode())]
        return self.send(topic, value, key=key, headers=headers)

    def _checked_key(self, topic: str, value: bytes | None, key: bytes | str | None,
                     headers: list[tuple[str, bytes]] | None, check_size: bool) -> bytes | None:
        """The key as bytes; RecordTooLarge when the record is over `limit` and `check_size`."""
        key_bytes = key.encode() if isinstance(key, str) else key
        size = record_size(value, key_bytes, headers)
        if check_size and size > self.limit:
            raise RecordTooLarge(f"record for topic {topic!r} is {size} bytes, over the limit of {self.limit} "
                                 "bytes (kafka.max_record_bytes); it was not sent")
        return key_bytes


class SourceBase:
    """Iteration and replay bounds, over an implementation's `poll`, offsets and `read_offsets`."""

    def __iter__(self: RecordSource) -> Iterator[Message]:
        while True:
            yield from self.poll()

    def read_range(self: RecordSource, topic: str, *, start: dict[str, int] | None = None,
                   end: dict[str, int] | None = None, from_time_ms: int | None = None, to_time_ms: int | None = None,
                   idle_timeout_s: float = 10.0) -> Iterator[Message]:
        """Replay `[start, end)` offsets (default: whole topic as of now), optionally bounded by record
        time `[from_time_ms, to_time_ms)` (each record's own timestamp). Needs a source without a group.
        Each partition's records come in offset order; partitions interleave."""
        begin, stop = self.replay_bounds(topic, start=start, end=end, from_time_ms=from_time_ms)
        yield from self.read_offsets(begin, stop, from_time_ms=from_time_ms, to_time_ms=to_time_ms,
                                     idle_timeout_s=idle_timeout_s)

    def replay_bounds(self: RecordSource, topic: str, *, start: dict[str, int] | None = None,
                      end: dict[str, int] | None = None,
                      from_time_ms: int | None = None) -> tuple[dict[str, int], dict[str, int]]:
        """`(begin, stop)` offsets per partition of `topic` for a replay: the topic's current extent,
        narrowed by `start`/`end` ("topic:partition" -> offset) and by the first record at or after
        `from_time_ms`. A partition with nothing to read has `begin >= stop`."""
        begin = dict(self.beginning_offsets(topic))
        if from_time_ms is not None:
            begin.update(self.offsets_for_time(topic, from_time_ms))
        if start:
            begin.update({k: max(v, begin.get(k, 0)) for k, v in start.items()})
        stop = dict(self.end_offsets(topic))
        if end:
            stop.update({k: min(v, stop.get(k, v)) for k, v in end.items()})
        return begin, stop


def resolve_claims(message: Message, store: ClaimStore | None) -> Message:
    """`message` with its claim-checked parts fetched, verified and put back inline (`check_in`), the `rft-claims`
    header dropped: what `rft.schema`'s decoders read and what other ranks can be sent. The same message when it
    carries none. RecordError naming the claim and the reason (dead-letter the message as it was read), also when
    its `rft-claims` header does not count its claims."""
    header = next((v or b"" for k, v in message.headers if k == HEADER_CLAIMS), None)
    value = check_in(message.value, store)
    if value is message.value and header is None:
        return message
    if header is not None:
        found = len(claims_in(message.value))
        if header != str(found).encode():
            raise RecordError(f"header {HEADER_CLAIMS} says {header.decode(errors='replace')[:20]!r} claims, the "
                              f"record holds {found}")
    return dataclasses.replace(message, value=value, headers=[h for h in message.headers if h[0] != HEADER_CLAIMS])


# --------------------------------------------------------------------------------------------------
# Dead letters


class DeadLetter:
    """Decode-or-divert over any RecordSink: `decode(messages)` returns the decoded records (their claims resolved
    from `claims`, `resolve_claims`) and sends every record that fails to resolve or decode, byte-for-byte, to the
    dead-letter topic with the reason in the `rft-error` header and its origin (`topic:partition@offset`) in
    `rft-origin`; consumption goes on. Counts by reason. A consumer that commits its position past a diverted record
    first calls `flush()`: every dead letter sent since is on the topic, or TransportError (and nothing is committed:
    the record is read, and diverted, again)."""

    def __init__(self, sink: RecordSink, topic: str, *, claims: ClaimStore | None = None):
        self.sink, self.topic, self.claims = sink, topic, claims
        self.count = 0
        self.reasons: dict[str, int] = {}
        self._sent = 0  # dead letters sent since the last flush
        self._failed: list[tuple[str, BaseException]] = []  # (origin, error) of sends that failed (the IO thread's)

    def flush(self, timeout_s: float = 60.0) -> None:
        """Wait until every dead letter sent since the last flush is on the topic; TransportError naming the first
        that is not (the caller must not commit its position past that record)."""
        sent, self._sent = self._sent, 0
        if sent:
            try:
                self.sink.flush(timeout_s)
            except Exception as e:  # the client's own timeout or closed-producer errors
                raise TransportError(f"{sent} dead letter(s) to {self.topic} not confirmed: {e}") from e
        if self._failed:
            (origin, error), self._failed = self._failed[0], []
            raise TransportError(f"the dead letter of {origin} did not reach {self.topic}: {error}")

    def decode(self, messages: Iterable[Message], decoder: Callable[[bytes, list], Any]) -> list[tuple[Message, Any]]:
        """(message as read, record) for each message that decodes."""
        out = []
        for m in messages:
            try:
                inline = resolve_claims(m, self.claims)
                out.append((m, decoder(inline.value, inline.headers)))
            except RecordError as e:
                self.divert(m, str(e))
        return out

    def divert(self, m: Message, reason: str) -> None:
        """Copy `m` to the dead-letter topic with the reason and its origin. A record larger than the sink may send
        (a foreign producer's, up to what the broker took) goes without its value, its size in `rft-omitted-bytes`:
        the value stays on its origin until the topic's retention, and the consumer goes on (never a crash loop)."""
        log.warning("dead-letter %s@%d: %s", m.position, m.offset, reason)
        headers = [h for h in m.headers if h[0] not in (HEADER_ERROR, HEADER_ORIGIN, HEADER_OMITTED)]
        headers += [(HEADER_ERROR, reason.encode()[:4096]), (HEADER_ORIGIN, f"{m.position}@{m.offset}".encode())]
        value = m.value or b""
        limit = getattr(self.sink, "limit", None)
        if limit is not None and record_size(value, m.key, headers) > limit:
            headers.append((HEADER_OMITTED, str(len(value)).encode()))
            value = b""
        origin = f"{m.position}@{m.offset}"
        future = self.sink.send(self.topic, value, key=m.key, headers=headers, check_size=False)
        future.add_errback(lambda error: self._failed.extend([(origin, error)][:64 - len(self._failed)]))
        self._sent += 1
        self.count += 1
        kind = reason.split(":")[0][:80]
        self.reasons[kind] = self.reasons.get(kind, 0) + 1
