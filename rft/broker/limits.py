"""A Kafka-protocol proxy in front of the local broker that enforces `message.max.bytes` as Apache Kafka does.

Tansu accepts a record batch of any size; Kafka refuses one over `message.max.bytes` (1 MB by default) with
MESSAGE_TOO_LARGE. `SizeLimitProxy` listens on loopback and relays every request frame (4-byte big-endian length,
then the payload) to the broker and every response back, unchanged, except a Produce request (api key 0) holding a
record batch larger than `max_message_bytes` (a batch's size as Kafka counts it: its 12-byte offset and length
prefix plus its length): those partitions are not written. Each partition with a batch over the limit gets error
code 10 (MESSAGE_TOO_LARGE) and offset -1, as Kafka answers; the request's other partitions go to the broker (the
request is re-framed without the refused ones) and their answers are merged with the refusals into one response of
the request's version and correlation id. When every partition is refused the proxy answers alone. An acks=0
request with a refused partition is answered, as Kafka does, by closing the connection.

Responses leave in request order per connection (clients pipeline requests): each request takes a place in the
connection's queue, and an answer the proxy makes is written only after every earlier forwarded one.

Produce versions 0 to 13 are parsed (non-flexible up to 8; 9 and later flexible: compact strings, arrays and bytes,
tagged fields; 13 names topics by id). A Produce request of another version, or one that does not parse, closes its
connection with an error logged: nothing oversize gets through unchecked. Only a Produce frame longer than the
limit is parsed at all (a shorter one cannot hold a batch over it), besides the few bytes that say whether it
expects an answer. `max_message_bytes=None` relays everything (the same path, no limit).

The broker must advertise the proxy's address (Tansu's --advertised-listener-url), so Metadata and FindCoordinator
answers keep clients on the proxy; `rft.broker.local.LocalBroker(max_message_bytes=N)` starts both that way.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import struct
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

log = logging.getLogger(__name__)

PRODUCE = 0
MESSAGE_TOO_LARGE = 10
MAX_PRODUCE_VERSION = 13
FLEXIBLE_FROM = 9  # Produce request and response: compact encodings and tagged fields from this version
MAX_REQUEST_BYTES = 100 * 1024 * 1024  # Kafka's socket.request.max.bytes: a longer frame closes the connection
STREAM_BUFFER_BYTES = 8 * 1024 * 1024  # asyncio's stream buffer (64 KiB by default: a 1 MB frame took ~16 pauses)


class ProtocolError(ValueError):
    """A frame that does not parse as the Kafka protocol says it must (or of a version not parsed here)."""


class _Reader:
    """Kafka's primitive types read from one frame; ProtocolError past its end or on a negative length."""

    def __init__(self, data: bytes | memoryview, pos: int = 0):
        self.data, self.pos = memoryview(data), pos

    def take(self, n: int) -> memoryview:
        if n < 0 or self.pos + n > len(self.data):
            raise ProtocolError(f"frame ends at byte {len(self.data)}, a field needs {n} bytes at {self.pos}")
        out = self.data[self.pos:self.pos + n]
        self.pos += n
        return out

    def int16(self) -> int:
        return struct.unpack(">h", self.take(2))[0]

    def int32(self) -> int:
        return struct.unpack(">i", self.take(4))[0]

    def uvarint(self) -> int:
        value = shift = 0
        while True:
            b = self.take(1)[0]
            value |= (b & 0x7F) << shift
            if not b & 0x80:
                return value
            shift += 7
            if shift > 28:
                raise ProtocolError(f"unsigned varint longer than 5 bytes at byte {self.pos}")

    def length(self, flexible: bool, *, int16: bool = False) -> int:
        """A string's, bytes' or array's length (-1: null): compact (uvarint N+1) when flexible."""
        if flexible:
            return self.uvarint() - 1
        n = self.int16() if int16 else self.int32()
        if n < -1:
            raise ProtocolError(f"negative length {n} before byte {self.pos}")
        return n

    def string(self, flexible: bool) -> None:
        n = self.length(flexible, int16=True)
        if n > 0:
            self.take(n)

    def tagged_fields(self) -> None:
        for _ in range(self.uvarint()):
            self.uvarint()
            self.take(self.uvarint())


def _uvarint(n: int) -> bytes:
    out = bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _array_length(n: int, flexible: bool) -> bytes:
    return _uvarint(n + 1) if flexible else struct.pack(">i", n)


def _nullable_string(s: str | None, flexible: bool) -> bytes:
    if s is None:
        return _uvarint(0) if flexible else struct.pack(">h", -1)
    raw = s.encode()
    return (_uvarint(len(raw) + 1) if flexible else struct.pack(">h", len(raw))) + raw


@dataclass
class Partition:
    """One partition of a Produce request: its index, its raw bytes in the frame, its largest record batch."""
    index: int
    raw: memoryview
    largest_batch: int


@dataclass
class Topic:
    """One topic of a Produce request: its name (or id, v13) as encoded, its partitions, its trailing tagged
    fields as encoded."""
    key: bytes
    partitions: list[Partition] = field(default_factory=list)
    tail: bytes = b""


@dataclass
class ProduceRequest:
    """What the proxy needs of a Produce request: `head` is the frame up to the topic array (header, transactional
    id, acks, timeout), `tail` what follows it (the request's tagged fields)."""
    version: int
    correlation_id: int
    acks: int
    head: bytes
    topics: list[Topic]
    tail: bytes

    @property
    def flexible(self) -> bool:
        return self.version >= FLEXIBLE_FROM

    def encode(self, topics: list[Topic]) -> bytes:
        """The request's payload (no length prefix) with only `topics`."""
        out = [self.head, _array_length(len(topics), self.flexible)]
        for t in topics:
            out += [t.key, _array_length(len(t.partitions), self.flexible), *(bytes(p.raw) for p in t.partitions),
                    t.tail]
        out.append(self.tail)
        return b"".join(out)


def request_header(payload: bytes | memoryview) -> tuple[int, int, int]:
    """(api key, api version, correlation id) of a request payload."""
    r = _Reader(payload)
    return r.int16(), r.int16(), r.int32()


def _skip_request_header(r: _Reader, version: int) -> None:
    r.int16(), r.int16(), r.int32()
    r.string(False)  # client_id: a nullable string even in flexible headers
    if version >= FLEXIBLE_FROM:
        r.tagged_fields()


def produce_acks(payload: bytes | memoryview) -> int:
    """The acks of a Produce request payload (0: the client expects no answer)."""
    r = _Reader(payload)
    version = request_header(payload)[1]
    _check_version(version)
    _skip_request_header(r, version)
    if version >= 3:
        r.string(version >= FLEXIBLE_FROM)
    return r.int16()


def _check_version(version: int) -> None:
    if not 0 <= version <= MAX_PRODUCE_VERSION:
        raise ProtocolError(f"Produce version {version} is not parsed by this proxy (0 to {MAX_PRODUCE_VERSION})")


def batch_sizes(records: memoryview) -> list[int]:
    """The size of each record batch (or legacy message set entry) in a partition's records, as Kafka counts it
    against message.max.bytes: the 8-byte base offset and 4-byte length, plus the length."""
    sizes, pos = [], 0
    while pos + 12 <= len(records):
        length = struct.unpack_from(">i", records, pos + 8)[0]
        if length < 0:
            raise ProtocolError(f"record batch with negative length {length}")
        sizes.append(12 + length)
        pos += 12 + length
    return sizes


def parse_produce(payload: bytes | memoryview) -> ProduceRequest:
    """A Produce request payload, parsed as far as the proxy needs; ProtocolError when it does not parse."""
    r = _Reader(payload)
    _, version, correlation_id = request_header(payload)
    _check_version(version)
    flexible = version >= FLEXIBLE_FROM
    _skip_request_header(r, version)
    if version >= 3:
        r.string(flexible)
    acks = r.int16()
    r.int32()
    head = bytes(r.data[:r.pos])
    topics = []
    for _ in range(max(0, r.length(flexible))):
        start = r.pos
        if version >= 13:
            r.take(16)
        else:
            r.string(flexible)
        topic = Topic(bytes(r.data[start:r.pos]))
        for _ in range(max(0, r.length(flexible))):
            start = r.pos
            index = r.int32()
            n = r.length(flexible)
            records = r.take(n) if n > 0 else memoryview(b"")
            if flexible:
                r.tagged_fields()
            topic.partitions.append(Partition(index, r.data[start:r.pos], max(batch_sizes(records), default=0)))
        start = r.pos
        if flexible:
            r.tagged_fields()
        topic.tail = bytes(r.data[start:r.pos])
        topics.append(topic)
    tail = bytes(r.data[r.pos:])
    if flexible:
        r.tagged_fields()
    if r.pos != len(r.data):
        raise ProtocolError(f"Produce v{version} request has {len(r.data) - r.pos} bytes past its end")
    return ProduceRequest(version, correlation_id, acks, head, topics, tail)


def refused_partition(version: int, index: int, message: str) -> bytes:
    """One partition's answer in a ProduceResponse of `version`: MESSAGE_TOO_LARGE, offsets -1, `message`."""
    flexible = version >= FLEXIBLE_FROM
    out = struct.pack(">ihq", index, MESSAGE_TOO_LARGE, -1)
    if version >= 2:
        out += struct.pack(">q", -1)  # log_append_time_ms
    if version >= 5:
        out += struct.pack(">q", -1)  # log_start_offset
    if version >= 8:
        out += _array_length(0, flexible) + _nullable_string(message, flexible)  # record_errors, error_message
    if flexible:
        out += _uvarint(0)
    return out


def _response_header(correlation_id: int, version: int) -> bytes:
    return struct.pack(">i", correlation_id) + (_uvarint(0) if version >= FLEXIBLE_FROM else b"")


def produce_response(version: int, correlation_id: int, topics: list[tuple[bytes, list[bytes]]]) -> bytes:
    """A ProduceResponse payload of `version` answering `topics` (each: its name or id as encoded, and its
    partitions' answers as encoded), throttle time 0."""
    flexible = version >= FLEXIBLE_FROM
    out = [_response_header(correlation_id, version), _array_length(len(topics), flexible)]
    for key, partitions in topics:
        out += [key, _array_length(len(partitions), flexible), *partitions, _uvarint(0) if flexible else b""]
    if version >= 1:
        out.append(struct.pack(">i", 0))
    if flexible:
        out.append(_uvarint(0))
    return b"".join(out)


def merge_refusals(version: int, response: bytes | memoryview, refused: list[tuple[bytes, list[bytes]]]) -> bytes:
    """The broker's ProduceResponse payload `response` with the `refused` partitions' answers added to their
    topics (a topic the broker did not answer for is appended)."""
    flexible = version >= FLEXIBLE_FROM
    r = _Reader(response)
    correlation_id = r.int32()
    if flexible:
        r.tagged_fields()
    topics: list[tuple[bytes, list[bytes], bytes]] = []
    for _ in range(max(0, r.length(flexible))):
        start = r.pos
        if version >= 13:
            r.take(16)
        else:
            r.string(flexible)
        key = bytes(r.data[start:r.pos])
        partitions = []
        for _ in range(max(0, r.length(flexible))):
            start = r.pos
            r.take(4 + 2 + 8 + (8 if version >= 2 else 0) + (8 if version >= 5 else 0))
            if version >= 8:
                for _ in range(max(0, r.length(flexible))):
                    r.int32()
                    r.string(flexible)
                r.string(flexible)
            if flexible:
                r.tagged_fields()
            partitions.append(bytes(r.data[start:r.pos]))
        start = r.pos
        if flexible:
            r.tagged_fields()
        topics.append((key, partitions, bytes(r.data[start:r.pos])))
    rest = bytes(r.data[r.pos:])
    extra: dict[bytes, list[bytes]] = {}
    for key, parts in refused:
        extra.setdefault(key, []).extend(parts)
    for key, partitions, _ in topics:
        partitions.extend(extra.pop(key, []))
    topics.extend((key, parts, _uvarint(0) if flexible else b"") for key, parts in extra.items())
    out = [_response_header(correlation_id, version), _array_length(len(topics), flexible)]
    for key, partitions, tail in topics:
        out += [key, _array_length(len(partitions), flexible), *partitions, tail]
    out.append(rest)
    return b"".join(out)


@dataclass
class Verdict:
    """What to do with one request: forward `payload` (None: nothing) and answer with `answer` (the proxy's own
    response), or with the broker's response passed through `transform`; `expects_response` False for acks=0;
    `close` closes the connection once the earlier answers are out."""
    payload: bytes | memoryview | None
    expects_response: bool = True
    answer: bytes | None = None
    transform: Callable[[bytes], bytes] | None = None
    close: bool = False


def judge(payload: bytes | memoryview, limit: int | None) -> Verdict:
    """The verdict on one request payload under `limit` (ProtocolError: close the connection)."""
    api_key, version, correlation_id = request_header(payload)
    if api_key != PRODUCE:
        return Verdict(payload)
    acks = produce_acks(payload)
    if limit is None or len(payload) <= limit:
        return Verdict(payload, expects_response=acks != 0)
    request = parse_produce(payload)
    kept: list[Topic] = []
    refused: list[tuple[bytes, list[bytes]]] = []
    for topic in request.topics:
        ok = [p for p in topic.partitions if p.largest_batch <= limit]
        over = [p for p in topic.partitions if p.largest_batch > limit]
        if ok:
            kept.append(Topic(topic.key, ok, topic.tail))
        if over:
            refused.append((topic.key, [refused_partition(version, p.index, (
                f"The record batch size in the append to partition {p.index} is {p.largest_batch} bytes which "
                f"exceeds the maximum configured value of {limit}.")) for p in over]))
    if not refused:
        return Verdict(payload, expects_response=acks != 0)
    log.warning("Produce v%d (correlation id %d): refused %d partition(s) with a record batch over %d bytes",
                version, correlation_id, sum(len(p) for _, p in refused), limit)
    if acks == 0:
        return Verdict(request.encode(kept) if kept else None, expects_response=False, close=True)
    if not kept:
        return Verdict(None, answer=produce_response(version, correlation_id, refused))
    return Verdict(request.encode(kept), transform=lambda response: merge_refusals(version, response, refused))


async def _read_frame(reader: asyncio.StreamReader, limit: int | None) -> bytes | None:
    """One frame's payload; None at a clean end of stream."""
    try:
        size = struct.unpack(">i", await reader.readexactly(4))[0]
    except asyncio.IncompleteReadError as e:
        if e.partial:
            raise ProtocolError("stream ended inside a frame's length") from None
        return None
    if size < 0 or (limit is not None and size > limit):
        raise ProtocolError(f"frame length {size} is out of range")
    return await reader.readexactly(size)


def _write_frame(writer: asyncio.StreamWriter, payload: bytes | memoryview) -> None:
    writer.writelines([struct.pack(">i", len(payload)), payload])  # no copy of the payload into a joined frame


class _Connection:
    """One client connection and its own connection to the broker."""

    def __init__(self, proxy: SizeLimitProxy, client: tuple[asyncio.StreamReader, asyncio.StreamWriter],
                 broker: tuple[asyncio.StreamReader, asyncio.StreamWriter]):
        self.proxy = proxy
        self.client_reader, self.client_writer = client
        self.broker_reader, self.broker_writer = broker
        self.outbox: asyncio.Queue[asyncio.Future[bytes | None]] = asyncio.Queue()
        self.awaiting: deque[tuple[int, asyncio.Future[bytes | None], Callable[[bytes], bytes] | None]] = deque()

    async def run(self) -> None:
        tasks = [asyncio.ensure_future(c) for c in (self._requests(), self._responses(), self._answers())]
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            for t in done:
                if not t.cancelled() and t.exception() is not None:
                    e = t.exception()
                    level = logging.ERROR if isinstance(e, ProtocolError) else logging.DEBUG
                    log.log(level, "size-limit proxy: closing a connection: %s", e)
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            for w in (self.client_writer, self.broker_writer):
                w.close()

    async def _requests(self) -> None:
        loop = asyncio.get_running_loop()
        while (payload := await _read_frame(self.client_reader, MAX_REQUEST_BYTES)) is not None:
            try:
                verdict = judge(payload, self.proxy.max_message_bytes)
            except ProtocolError as e:
                key, version, cid = request_header(payload) if len(payload) >= 8 else (-1, -1, -1)
                raise ProtocolError(f"request api key {key} v{version} (correlation id {cid}): {e}") from None
            if verdict.answer is not None or verdict.transform is not None or verdict.close:
                self.proxy.refused += 1
            if verdict.payload is not None:
                _write_frame(self.broker_writer, verdict.payload)
                await self.broker_writer.drain()
            if verdict.answer is not None:
                done: asyncio.Future[bytes | None] = loop.create_future()
                done.set_result(verdict.answer)
                self.outbox.put_nowait(done)
            elif verdict.payload is not None and verdict.expects_response:
                pending: asyncio.Future[bytes | None] = loop.create_future()
                self.awaiting.append((request_header(verdict.payload)[2], pending, verdict.transform))
                self.outbox.put_nowait(pending)
            if verdict.close:
                closing: asyncio.Future[bytes | None] = loop.create_future()
                closing.set_result(None)
                self.outbox.put_nowait(closing)
                await asyncio.Event().wait()  # the answers task ends the connection

    async def _responses(self) -> None:
        while (payload := await _read_frame(self.broker_reader, None)) is not None:
            if not self.awaiting:
                raise ProtocolError("the broker answered a request that was not sent")
            correlation_id, pending, transform = self.awaiting.popleft()
            got = struct.unpack_from(">i", payload)[0] if len(payload) >= 4 else None
            if got != correlation_id:
                raise ProtocolError(f"the broker answered correlation id {got}, expected {correlation_id}")
            pending.set_result(transform(payload) if transform is not None else payload)

    async def _answers(self) -> None:
        while True:
            answer = await (await self.outbox.get())
            if answer is None:
                return
            _write_frame(self.client_writer, answer)
            await self.client_writer.drain()


class SizeLimitProxy:
    """The proxy (module docstring) on `host:port` (0: any free port) in front of `upstream` ("host:port"), in a
    thread with its own event loop. `start()` returns once it listens; `stop()` closes the listener and every
    connection. `refused`: how many requests had a partition refused."""

    def __init__(self, upstream: str, max_message_bytes: int | None, *, host: str = "127.0.0.1", port: int = 0):
        if max_message_bytes is not None and max_message_bytes < 1:
            raise ValueError(f"max_message_bytes must be a positive number of bytes, got {max_message_bytes}")
        up_host, _, up_port = upstream.rpartition(":")
        self.upstream = (up_host, int(up_port))
        self.max_message_bytes = max_message_bytes
        self.host, self.port = host, port
        self.refused = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopped: asyncio.Event | None = None

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def start(self, timeout_s: float = 10.0) -> SizeLimitProxy:
        started = threading.Event()
        failure: list[BaseException] = []

        def serve() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            try:
                loop.run_until_complete(self._serve(started))
            except BaseException as e:  # reported by start()
                failure.append(e)
                started.set()
            finally:
                loop.close()

        self._thread = threading.Thread(target=serve, name=f"size-limit-proxy:{self.port}", daemon=True)
        self._thread.start()
        if not started.wait(timeout_s) or failure:
            self.stop()
            raise OSError(f"the size-limit proxy could not listen on {self.host}:{self.port}: "
                          f"{failure[0] if failure else 'timed out'}")
        return self

    async def _serve(self, started: threading.Event) -> None:
        self._stopped = asyncio.Event()
        connections: set[asyncio.Task] = set()

        async def accept(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            task = asyncio.current_task()
            assert task is not None
            connections.add(task)
            try:
                try:
                    broker = await asyncio.open_connection(*self.upstream, limit=STREAM_BUFFER_BYTES)
                except OSError as e:
                    log.error("size-limit proxy: cannot reach the broker at %s:%d: %s", *self.upstream, e)
                    writer.close()
                    return
                await _Connection(self, (reader, writer), broker).run()
            except asyncio.CancelledError:  # stop(): end quietly (asyncio's server logs a handler cancelled)
                pass
            finally:
                connections.discard(task)

        server = await asyncio.start_server(accept, self.host, self.port, reuse_address=True,
                                            limit=STREAM_BUFFER_BYTES)
        self.port = server.sockets[0].getsockname()[1]
        started.set()
        async with server:
            await self._stopped.wait()
            server.close()
            for task in list(connections):
                task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.gather(*connections, return_exceptions=True)

    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def stop(self) -> None:
        loop, thread = self._loop, self._thread
        if loop is not None and thread is not None and thread.is_alive() and self._stopped is not None:
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                loop.call_soon_threadsafe(self._stopped.set)
            thread.join(10)
        self._thread = None
