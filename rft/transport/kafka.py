"""The Kafka implementations of rft.transport's protocols; the only module of rft that imports kafka-python.

`KafkaTransport(kafka_cfg, bootstrap)` builds `KafkaSink`, `KafkaSource` and `KafkaAdmin`; their delivery
semantics are the protocols' (rft/transport/__init__.py). kafka-python objects (TopicPartition, futures,
record metadata) stay inside this module: positions leave as "topic:partition" strings, futures as
`KafkaSendFuture`. It also carries the workarounds for kafka-python 3.0.x and Tansu described where they are.
"""
from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from kafka import ConsumerRebalanceListener, KafkaAdminClient, KafkaConsumer, KafkaProducer, TopicPartition
from kafka.admin import NewTopic
from kafka.errors import KafkaError, KafkaTimeoutError, OffsetOutOfRangeError, TopicAlreadyExistsError
from kafka.structs import OffsetAndMetadata

from rft.transport.base import (
    BrokerUnreachable,
    Message,
    PartitionInfo,
    Position,
    RecordMetadata,
    SinkBase,
    SourceBase,
    TransportError,
    offset_key,
    parse_offset_key,
    probe_bootstrap,
)
from rft.transport.claims import ClaimStore
from rft.transport.config import KafkaConfig
from rft.transport.inflation import InflatedBatchTooLarge, install_inflation_bound

_OVERHEAD_BYTES = 64 * 1024  # room for the batch and header framing around one maximal record
# a consumer fetches records far larger than its own producers send (a foreign producer's, up to a managed broker's
# 8-20 MB), so that it reads and dead-letters them rather than stalling on them
_FETCH_FLOOR_BYTES = 32 << 20


_STUCK_CALL_S = 20.0
HOLE_WAIT_S = 5.0  # a hole in a partition's offsets still there after this long is passed over (KafkaSource.poll)

log = logging.getLogger(__name__)


class StuckClientError(RuntimeError):
    """A kafka-python call that would have blocked forever (see `_nudge_stuck_waits`). Not a KafkaError, so
    that kafka-python's own handlers (which swallow KafkaTimeoutError in poll) let it through."""


def _nudge_stuck_waits() -> None:
    """Work around a kafka-python 3.0.x hang (dpkp/kafka-python#3121, fixed upstream by #3123/#3124, not in
    3.0.12, the newest release): a caller thread blocks in `NetworkSelector.run()` on `event.wait()` with no
    timeout while the IO thread sits idle in select(), so `poll(timeout_ms=500)` never returns. Seen here: the
    trainer's feed hung in poll, an explorer in end_offsets. This is kafka-python's own run() with two changes:
    the caller waits in one-second slices and wakes the IO loop between them, and gives up after
    `_STUCK_CALL_S` (a timed wait: after its own timeout) with StuckClientError. KafkaSource turns that into
    TransportError; callers that hold their own positions (the trainer's feed, admission) reconnect."""
    from kafka.net import selector

    if getattr(selector.NetworkSelector.run, "_rft_nudged", False):
        return
    original = selector.NetworkSelector.run

    def run(self, coro, *args):
        if self._io_thread is None or threading.current_thread() is self._io_thread or self._exception:
            return original(self, coro, *args)
        event = threading.Event()
        state = {"value": None, "exception": None}

        async def waiter():
            try:
                state["value"] = await self._invoke(coro, *args)
            except BaseException as exc:
                if state["exception"] is None:
                    state["exception"] = exc
            finally:
                with self._pending_waiters_lock:
                    self._pending_waiters.pop(event, None)
                event.set()

        with self._pending_waiters_lock:
            self._pending_waiters[event] = state
        self.call_soon_threadsafe(waiter)
        limit_s = _STUCK_CALL_S
        if getattr(coro, "__name__", "") == "wait_for" and args and isinstance(args[-1], (int, float)):
            limit_s = args[-1] / 1000 + 2.0  # a timed wait (poll's fetch wait): its own timeout, plus slack
        deadline = time.monotonic() + limit_s
        while not event.wait(min(1.0, limit_s)):
            if time.monotonic() > deadline:
                with self._pending_waiters_lock:
                    self._pending_waiters.pop(event, None)
                raise StuckClientError(f"kafka-python call {getattr(coro, '__name__', coro)} did not complete "
                                       f"in {limit_s:.1f} s (dpkp/kafka-python#3121)")
            self.wakeup()
        if state["exception"] is not None:
            raise state["exception"]
        return state["value"]

    vars(run)["_rft_nudged"] = True  # the marker checked above: patched once per process
    selector.NetworkSelector.run = run


_nudge_stuck_waits()
install_inflation_bound()  # a compressed batch inflates into at most inflation.MAX_INFLATED_BYTES (KafkaSource.poll)


def _tp(key: str) -> TopicPartition:
    position = parse_offset_key(key)
    return TopicPartition(position.topic, position.partition)


def _key(tp: TopicPartition) -> Position:
    return offset_key(tp.topic, tp.partition)


def _client_settings(cfg: KafkaConfig, bootstrap: str) -> dict[str, Any]:
    return {"bootstrap_servers": bootstrap.split(","), "request_timeout_ms": cfg.request_timeout_ms,
            **cfg.security}


def _connect(factory: Callable[..., Any], what: str, bootstrap: str, **settings: Any) -> Any:
    probe_bootstrap(bootstrap)  # BrokerUnreachable in seconds (kafka-python would wait _STUCK_CALL_S, then raise)
    try:
        return factory(**settings)
    except (KafkaTimeoutError, StuckClientError):
        raise BrokerUnreachable(f"cannot reach the Kafka broker at {bootstrap} (creating the {what}); "
                                "check kafka.bootstrap_servers, or use `embedded` for a local broker") from None


_PROBE_KEYS = ("bootstrap_servers", "client_id", "request_timeout_ms", "security_protocol", "ssl_context",
               "ssl_check_hostname", "ssl_cafile", "ssl_certfile", "ssl_keyfile", "ssl_password", "sasl_mechanism",
               "sasl_plain_username", "sasl_plain_password", "sasl_oauth_token_provider",
               "max_partition_fetch_bytes", "fetch_max_bytes")


class KafkaSendFuture:
    """A kafka-python send future behind rft's `SendFuture`: metadata as `RecordMetadata`, errors as
    TransportError."""

    def __init__(self, future: Any):
        self._future = future

    def get(self, timeout: float | None = None) -> RecordMetadata:
        try:
            meta = self._future.get(timeout=timeout)
        except KafkaError as e:
            raise TransportError(f"send to the broker failed: {e!r}") from e
        return RecordMetadata(meta.topic, meta.partition, meta.offset, meta.timestamp)

    def add_errback(self, callback: Callable[[BaseException], Any]) -> None:
        self._future.add_errback(callback)


class KafkaSink(SinkBase):
    """rft.transport.RecordSink on a kafka-python producer (acks=all, idempotent; thread-safe as it is)."""

    def __init__(self, cfg: KafkaConfig, bootstrap: str, *, client_id: str = "rft", linger_ms: int = 5,
                 claims: ClaimStore | None = None):
        self.limit, self.claims = cfg.max_record_bytes, claims
        self._producer = _connect(
            KafkaProducer, "producer", bootstrap, **_client_settings(cfg, bootstrap), client_id=client_id,
            acks="all", enable_idempotence=True, linger_ms=linger_ms, compression_type=cfg.compression,
            max_request_size=self.limit + _OVERHEAD_BYTES,
            batch_size=min(1 << 20, self.limit))  # several records' batch stays within what the broker accepts

    def send(self, topic: str, value: bytes, *, key: bytes | str | None = None,
             headers: list[tuple[str, bytes]] | None = None, partition: int | None = None,
             timestamp_ms: int | None = None, check_size: bool = True) -> KafkaSendFuture:
        """Queue one record (see RecordSink)."""
        key_bytes = self._checked_key(topic, value, key, headers, check_size)
        return KafkaSendFuture(self._producer.send(topic, value=value, key=key_bytes, headers=headers or [],
                                                   partition=partition, timestamp_ms=timestamp_ms))

    def flush(self, timeout_s: float | None = None) -> None:
        self._producer.flush(timeout=timeout_s)

    def close(self) -> None:
        self._producer.close()


def _reset_policy(group: str | None, from_beginning: bool) -> str:
    """Group-less sources hold their own positions and never jump: Tansu reports a partition's end as its last
    batch's base offset + 1, so a consumer past it gets OFFSET_OUT_OF_RANGE, and kafka-python's reset policy
    would rewind it to the beginning. With "none" the error reaches `poll`, which stays put and retries."""
    if group is None:
        return "none"
    return "earliest" if from_beginning else "latest"


class _JoinListener(ConsumerRebalanceListener):
    """`joined` is set when the group's first answer to a join arrives (kafka-python calls `on_partitions_assigned`
    from `poll`, with the assignment, possibly empty); `KafkaSource.joined` reads it. A later rebalance does not clear
    it: a group that a leaving member wedges (Tansu) must not hold an explorer's idle clock for ever."""

    def __init__(self, joined: threading.Event):
        self._joined = joined

    def on_partitions_revoked(self, revoked) -> None:
        pass

    def on_partitions_assigned(self, assigned) -> None:
        self._joined.set()


class _GaplessReads:
    """Each partition's records without a gap from the offset it was sought to (KafkaSource's docstring, "Holes")."""

    def __init__(self) -> None:
        self.wait_s: float | None = None  # how long a hole is waited for; None: HOLE_WAIT_S
        self._next: dict[TopicPartition, int] = {}  # the offset each sought partition reads next
        self._first_seen: dict[tuple[TopicPartition, int], float] = {}  # (partition, missing offset) -> monotonic s

    def sought(self, tp: TopicPartition, offset: int) -> None:
        self._next[tp] = offset

    def forget(self) -> None:
        """Positions moved where this cannot follow (assign, seek to the beginning): check nothing until a seek."""
        self._next.clear()
        self._first_seen.clear()

    def records(self, tp: TopicPartition, records: list, consumer: KafkaConsumer) -> list:
        """`records` (one partition's, in offset order) up to the first hole after the offset it reads next; at a
        hole younger than HOLE_WAIT_S, seeks `consumer` back to it (dropping what it fetched past it)."""
        expected = self._next.get(tp)
        if expected is None:
            return records
        kept = []
        for r in records:
            if r.offset > expected:
                first_seen = self._first_seen.setdefault((tp, expected), time.monotonic())
                wait_s = HOLE_WAIT_S if self.wait_s is None else self.wait_s
                if time.monotonic() - first_seen < wait_s:
                    consumer.seek(tp, expected)
                    break
                log.warning("%s: offsets %d to %d never became readable in %.1f s: going on from %d", _key(tp),
                            expected, r.offset - 1, wait_s, r.offset)
                del self._first_seen[(tp, expected)]
            elif self._first_seen:  # a hole that filled: forget when it was seen
                self._first_seen.pop((tp, expected), None)
            kept.append(r)
            expected = r.offset + 1
        self._next[tp] = expected
        return kept


class KafkaSource(SourceBase):
    """rft.transport.RecordSource on a kafka-python consumer. `group` joins a consumer group (subscribe);
    without one, partitions are assigned explicitly with `assign()` / `seek()` (replay, trainer with stored
    offsets).

    Holes. Without a group, `poll` hands out each partition's records without a gap from the offset it was sought
    to: rft writes no transactions and compacts nothing, so every offset holds a record, and a record past a missing
    one means the missing one is not readable yet. Tansu advances a partition's watermark before it writes the
    batch (rft's embedded broker): with two producers on one partition (explorers on the experiences topic) the
    later batch can be listed before the earlier one, and a fetch at the earlier offset then answers with the later
    batch, which kafka-python hands out, passing over the earlier one for good. Here the source seeks back to the
    missing offset and polls again; a hole still there after HOLE_WAIT_S (a batch whose write failed after the
    watermark moved, or that a SIGKILL of the broker cut off) is passed over with a warning naming it. `read_offsets`
    waits a quarter of its idle timeout at a hole, and ends a partition whose position stays below its stop offset for
    half of it while the broker answers its fetches: the rest are holes (a tail a SIGKILL cut off)."""

    def __init__(self, cfg: KafkaConfig, bootstrap: str, *, group: str | None = None,
                 topics: Iterable[str] = (), client_id: str = "rft", from_beginning: bool = True,
                 group_instance_id: str | None = None):
        settings = dict(_client_settings(cfg, bootstrap), client_id=client_id, group_id=group,
                        enable_auto_commit=False, auto_offset_reset=_reset_policy(group, from_beginning),
                        session_timeout_ms=cfg.session_timeout_ms, max_poll_interval_ms=cfg.max_poll_interval_ms,
                        heartbeat_interval_ms=max(500, cfg.session_timeout_ms // 4),
                        max_partition_fetch_bytes=max(_FETCH_FLOOR_BYTES, cfg.max_record_bytes + _OVERHEAD_BYTES),
                        fetch_max_bytes=max(50 << 20, cfg.max_record_bytes + _OVERHEAD_BYTES),
                        receive_buffer_bytes=4 << 20)
        if group_instance_id:
            settings["group_instance_id"] = group_instance_id
        self._consumer = _connect(KafkaConsumer, "consumer", bootstrap, **settings)
        self._probe: KafkaConsumer | None = None
        self.group = group
        self._gapless = _GaplessReads()  # without a group (class docstring, "Holes")
        self.batches_refused = 0  # compressed batches passed over for inflating past the bound (poll)
        self._joined = threading.Event()
        if topics:
            if group is None:
                raise TransportError("subscribing to topics needs a consumer group; use assign() without one")
            self._consumer.subscribe(list(topics), listener=_JoinListener(self._joined))
        else:
            self._joined.set()

    @property
    def joined(self) -> bool:
        return self._joined.is_set()

    # -- reading
    def poll(self, timeout_s: float = 1.0, max_records: int | None = None) -> list[Message]:
        """Records in (topic, partition, offset) order. TransportError if the client is wedged (see
        `_nudge_stuck_waits`): the caller reconnects from the positions it keeps."""
        try:
            batches = self._consumer.poll(timeout_ms=int(timeout_s * 1000), max_records=max_records)
            if not batches:
                self._unstick_validation()
        except OffsetOutOfRangeError as e:
            for tp, offset in e.args[0].items():  # see _reset_policy: stay at the position and try again
                self._consumer.seek(tp, offset)
            time.sleep(min(timeout_s, 0.2))
            return []
        except (KafkaTimeoutError, StuckClientError) as e:
            raise TransportError(f"poll: {e}") from None
        except InflatedBatchTooLarge as e:  # a compression bomb: every record of it passed over, counted, logged
            self.batches_refused += 1
            log.error("%s: %s; passed over without reading it (refused so far: %d)",
                      _key(e.partition) if e.partition else "?", e, self.batches_refused)
            if e.partition is not None:
                self._consumer.seek(e.partition, e.next_offset)
                if self.group is None:
                    self._gapless.sought(e.partition, e.next_offset)
            return []
        out = [Message(r.topic, r.partition, r.offset, r.key, r.value, list(r.headers or []), r.timestamp)
               for tp, records in batches.items()
               for r in (records if self.group is not None else self._gapless.records(tp, records, self._consumer))]
        out.sort(key=lambda m: (m.topic, m.partition, m.offset))
        return out

    def _unstick_validation(self) -> None:
        """kafka-python 3.0.12 can stop fetching a partition whose position awaits leader-epoch validation
        (dpkp/kafka-python#3106: poll() schedules the validation but never waits for it, and keeps returning
        nothing). position() waits for it; seen here as a trainer starving beside a full experiences topic."""
        for tp in self._consumer.assignment():
            self._consumer.position(tp)

    # -- positions
    def _partitions(self, topic: str) -> list[TopicPartition]:
        parts = self._consumer.partitions_for_topic(topic)
        if not parts:
            raise TransportError(f"topic {topic!r} does not exist (or has no partitions)")
        return [TopicPartition(topic, p) for p in sorted(parts)]

    def partitions(self, topic: str) -> list[str]:
        return [_key(tp) for tp in self._partitions(topic)]

    def assign(self, topics: Iterable[str]) -> list[str]:
        tps = [tp for t in topics for tp in self._partitions(t)]
        self._consumer.assign(tps)
        self._gapless.forget()  # read from wherever kafka-python positions them, unchecked until a seek
        return [_key(tp) for tp in tps]

    def assignment(self) -> set[str]:
        return {_key(tp) for tp in self._consumer.assignment()}

    def seek(self, offsets: dict[str, int]) -> None:
        """Position at stored offsets ("topic:partition" -> next offset); assigns them if unassigned."""
        tps = {_tp(k): v for k, v in offsets.items()}
        if self.group is None:
            assigned = set(self._consumer.assignment())
            if set(tps) - assigned:
                self._consumer.assign(list(assigned | set(tps)))
        for tp, offset in tps.items():
            self._consumer.seek(tp, offset)
            self._gapless.sought(tp, offset)

    def seek_to_beginning(self) -> None:
        self._consumer.seek_to_beginning()
        self._gapless.forget()

    def positions(self) -> dict[str, int]:
        return {_key(tp): self._consumer.position(tp) for tp in self._consumer.assignment()}

    def commit(self, offsets: dict[str, int] | None = None) -> None:
        """Commit to the group: the given offsets, or the current positions."""
        if offsets is None:
            self._consumer.commit()
        else:
            self._consumer.commit({_tp(k): OffsetAndMetadata(v, "", -1) for k, v in offsets.items()})

    def committed(self, topic: str) -> dict[str, int | None]:
        return {_key(tp): self._consumer.committed(tp) for tp in self._partitions(topic)}

    def end_offsets(self, topic: str) -> dict[str, int]:
        """One past the last record of each partition: the high watermark.

        The broker's ListOffsets answer is not trusted on its own: Tansu answers with the base offset + 1 of the
        record batch whose object was written last, so a batch of 10 records reads as end 1, and a batch whose
        write finished after a later one's (produce requests in flight together) hides every batch after it. Each
        partition that holds records is fetched once from there, and its end is the high watermark the fetch
        response carries (Tansu's is the partition's watermark, the offset its produce advanced before acknowledging;
        Apache Kafka's is the log's high watermark, which the ListOffsets answer already was). Nothing is read to
        the end, so the answer does not depend on how many batches follow or how fast they come.
        TransportError when the broker cannot be asked, or sends no fetch response within 10 s."""
        tps = self._partitions(topic)
        try:
            reported = self._consumer.end_offsets(tps)
            starts = self._consumer.beginning_offsets(tps)
        except (KafkaTimeoutError, StuckClientError) as e:
            raise TransportError(f"end_offsets({topic!r}): {e}") from None
        probe_at = {tp: o - 1 for tp, o in reported.items() if o > starts[tp]}
        ends = {tp: max(o, starts[tp]) for tp, o in reported.items()}
        if probe_at:
            ends.update({tp: max(mark, ends[tp]) for tp, mark in self._high_watermarks(probe_at).items()})
        return {_key(tp): o for tp, o in ends.items()}

    def _high_watermarks(self, fetch_at: dict[TopicPartition, int], timeout_s: float = 10.0
                         ) -> dict[TopicPartition, int]:
        """The high watermark of each partition, from the response to one fetch at `fetch_at[tp]` (an offset that
        holds a record, so the fetch is answered at once). The records it returns are dropped."""
        if self._probe is None:  # kept for the life of the source: end offsets are asked for often
            self._probe = KafkaConsumer(**{k: v for k, v in self._consumer.config.items() if k in _PROBE_KEYS})
        probe = self._probe
        try:
            probe.assign(list(fetch_at))  # a fresh assignment: no high watermark known yet
            for tp, offset in fetch_at.items():
                probe.seek(tp, offset)
            deadline = time.monotonic() + timeout_s
            while True:
                marks = {tp: probe.highwater(tp) for tp in fetch_at}
                if all(mark is not None for mark in marks.values()):
                    return marks
                if time.monotonic() > deadline:
                    missing = sorted(_key(tp) for tp, mark in marks.items() if mark is None)
                    raise TransportError(f"end_offsets (reading the high watermark): no fetch response for "
                                         f"{', '.join(missing)} within {timeout_s:.0f} s")
                probe.poll(timeout_ms=200)
        except (KafkaTimeoutError, StuckClientError) as e:  # as every other call here: the caller's to retry
            raise TransportError(f"end_offsets (reading the high watermark): {e}") from None
        finally:
            probe.assign([])

    def beginning_offsets(self, topic: str) -> dict[str, int]:
        try:
            starts = self._consumer.beginning_offsets(self._partitions(topic))
        except (KafkaTimeoutError, StuckClientError) as e:
            raise TransportError(f"beginning_offsets({topic!r}): {e}") from None
        return {_key(tp): o for tp, o in starts.items()}

    def offsets_for_time(self, topic: str, timestamp_ms: int) -> dict[str, int]:
        """First offset at or after `timestamp_ms` per partition (the end offset when none is), as the
        broker answers it: a starting point, not a filter.

        Brokers differ: for a time past the last record Kafka answers None (-> the end offset here);
        Tansu 0.6 answers offset 0 stamped with its own append time whatever the records' timestamps.
        `read_range` therefore also filters every record by its own timestamp."""
        tps = self._partitions(topic)
        found = self._consumer.offsets_for_times({tp: timestamp_ms for tp in tps})
        ends = self.end_offsets(topic)
        out: dict[str, int] = {}
        for tp in tps:
            key, hit = _key(tp), found.get(tp)
            offset = ends[key] if hit is None else hit.offset
            if hit is not None and hit.timestamp is not None and hit.timestamp < timestamp_ms:
                offset = ends[key]
            out[key] = offset
        return out

    def read_offsets(self, begin: dict[str, int], stop: dict[str, int], *, from_time_ms: int | None = None,
                     to_time_ms: int | None = None, idle_timeout_s: float = 10.0) -> Iterator[Message]:
        """Yield the records in `[begin, stop)` of each partition named in `begin`, only those stamped
        in `[from_time_ms, to_time_ms)` when given. Only partitions with something to read are
        assigned, so `read_offsets({one partition}, ...)` fetches nothing else. Needs a source without
        a group; leaves the source assigned to those partitions."""
        if self.group is not None:
            raise TransportError("read_range / read_offsets need a source without a consumer group")
        pending = {k for k in begin if begin[k] < stop.get(k, 0)}
        self._consumer.assign([_tp(k) for k in sorted(pending)])
        self._gapless.forget()
        self.seek({k: begin[k] for k in pending})
        self._gapless.wait_s = idle_timeout_s / 4
        last_progress = time.monotonic()
        moved = dict.fromkeys(pending, last_progress)
        try:
            while pending:
                messages = self.poll(timeout_s=0.5)
                now = time.monotonic()
                if messages:
                    last_progress = now
                elif now - last_progress > idle_timeout_s:
                    raise TransportError(f"replay stalled: partitions {sorted(pending)} "
                                         f"returned nothing for {idle_timeout_s:.0f} s")
                for m in messages:
                    moved[m.position] = now
                    if m.position not in pending or m.offset >= stop[m.position]:
                        continue
                    if (from_time_ms is None or m.timestamp_ms >= from_time_ms) and \
                            (to_time_ms is None or m.timestamp_ms < to_time_ms):
                        yield m
                    if m.offset + 1 >= stop[m.position]:
                        pending.discard(m.position)
                for key in list(pending):
                    tp = _tp(key)
                    position = self._consumer.position(tp)
                    if position >= stop[key]:
                        pending.discard(key)
                    elif now - moved[key] > idle_timeout_s / 2 and self._consumer.highwater(tp) is not None:
                        log.warning("%s: offsets %d to %d never became readable in %.1f s: the read ends there",
                                    key, position, stop[key] - 1, idle_timeout_s / 2)
                        pending.discard(key)
        finally:
            self._gapless.wait_s = None

    def fetch(self, position: str, offset: int, *, idle_timeout_s: float = 10.0) -> Message | None:
        """The record at `offset` of `position` ("topic:partition"), re-read by seeking to it; None when the
        partition no longer holds it (deleted by retention or compaction). Needs a source without a group;
        leaves it assigned to that partition. TransportError if the broker returns nothing for `idle_timeout_s`
        (a wedged client, or an offset past the partition's end)."""
        tp = _tp(position)
        try:
            if offset < self._consumer.beginning_offsets([tp])[tp]:
                return None
        except (KafkaTimeoutError, StuckClientError) as e:
            raise TransportError(f"fetch {position}@{offset}: {e}") from None
        for message in self.read_offsets({position: offset}, {position: offset + 1}, idle_timeout_s=idle_timeout_s):
            return message
        return None

    def close(self) -> None:
        if self._probe is not None:
            self._probe.close(autocommit=False)
        self._consumer.close(autocommit=False)


def _group_name(group: Any) -> str:
    if isinstance(group, dict):
        return group.get("group_id") or group.get("group") or str(group)
    return group[0] if isinstance(group, tuple) else str(group)


class KafkaAdmin:
    """rft.transport.Admin on kafka-python's admin client."""

    def __init__(self, cfg: KafkaConfig, bootstrap: str):
        self.cfg, self.bootstrap = cfg, bootstrap
        self._admin = _connect(KafkaAdminClient, "admin client", bootstrap, **_client_settings(cfg, bootstrap))

    def create_topics(self, names: Iterable[str], partitions: int | None = None) -> list[str]:
        """Create missing topics; returns those created. Existing topics are left as they are."""
        existing = set(self._admin.list_topics())
        wanted = [n for n in names if n not in existing]
        if not wanted:
            return []
        new = [NewTopic(n, num_partitions=partitions or self.cfg.partitions,
                        replication_factor=self.cfg.replication_factor) for n in wanted]
        try:
            self._admin.create_topics(new)
        except TopicAlreadyExistsError:
            pass
        self._wait_for_metadata(wanted)
        return wanted

    def _wait_for_metadata(self, names: list[str], timeout_s: float = 15.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if set(names) <= set(self._admin.list_topics()):
                return
            time.sleep(0.1)
        raise TransportError(f"topics {names} were created but did not appear within {timeout_s:.0f} s")

    def list_topics(self) -> list[str]:
        return sorted(t for t in self._admin.list_topics() if not t.startswith("__"))

    def describe(self, topic: str) -> list[PartitionInfo]:
        source = KafkaSource(self.cfg, self.bootstrap)
        try:
            starts, ends = source.beginning_offsets(topic), source.end_offsets(topic)
        finally:
            source.close()
        return [PartitionInfo(parse_offset_key(k).partition, starts[k], ends[k]) for k in sorted(ends)]

    def groups(self) -> list[str]:
        return sorted(_group_name(g) for g in self._admin.list_groups())

    def group_offsets(self, group: str) -> dict[str, int]:
        offsets = self._admin.list_group_offsets(group).get(group, {})
        return {_key(tp): om.offset for tp, om in offsets.items()}

    def delete_topics(self, names: Iterable[str]) -> None:
        try:
            self._admin.delete_topics(list(names))
        except KafkaError as e:
            raise TransportError(f"deleting topics {list(names)} failed: {e}") from None

    def close(self) -> None:
        self._admin.close()


class KafkaTransport:
    """rft.transport.Transport for one Kafka cluster: `kafka_cfg` (sizes, timeouts, security) at `bootstrap`; `claims`
    the claim store its sinks claim-check with and its readers resolve from."""

    def __init__(self, kafka_cfg: KafkaConfig, bootstrap: str, *, claims: ClaimStore | None = None):
        self.kafka_cfg, self.bootstrap, self.claims = kafka_cfg, bootstrap, claims

    def sink(self, *, client_id: str = "rft", linger_ms: int = 5) -> KafkaSink:
        return KafkaSink(self.kafka_cfg, self.bootstrap, client_id=client_id, linger_ms=linger_ms,
                         claims=self.claims)

    def source(self, *, group: str | None = None, topics: Iterable[str] = (), client_id: str = "rft",
               from_beginning: bool = True, group_instance_id: str | None = None,
               max_poll_interval_ms: int | None = None) -> KafkaSource:
        cfg = self.kafka_cfg if max_poll_interval_ms is None else \
            dataclasses.replace(self.kafka_cfg, max_poll_interval_ms=max_poll_interval_ms)
        return KafkaSource(cfg, self.bootstrap, group=group, topics=topics, client_id=client_id,
                           from_beginning=from_beginning, group_instance_id=group_instance_id)

    def admin(self) -> KafkaAdmin:
        return KafkaAdmin(self.kafka_cfg, self.bootstrap)
