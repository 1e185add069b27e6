"""The local broker enforces a message size limit as Apache Kafka does (rft.broker.limits in front of Tansu; the
suite's shared `broker` fixture runs with tests/conftest.py's BROKER_MAX_MESSAGE_BYTES): kafka-python through rft's
sink and confluent-kafka (an independent client) get MESSAGE_TOO_LARGE for a batch over it and succeed under it;
consumer groups, commits and fetches work through the proxy; pipelined requests are answered in request order with
a refusal among them; a request holding a small and an oversize partition writes the small one; an acks=0 request
over the limit closes its connection; `rft broker --max-message-bytes` serves the limit, and a durable broker keeps
it across a crash. The parsing against
kafka-python's encoders: tests/unit/test_limits_protocol.py."""
from __future__ import annotations

import dataclasses
import os
import socket
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from kafka.protocol.consumer import FetchRequest
from kafka.protocol.producer import ProduceRequest, ProduceResponse
from kafka.record.memory_records import MemoryRecordsBuilder

from rft.broker.local import LocalBroker
from rft.processes import free_port
from rft.transport import TransportError, connect
from rft.transport.config import KafkaConfig
from tests.conftest import BROKER_MAX_MESSAGE_BYTES
from tests.waiting import wait_until

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]
LIMIT = BROKER_MAX_MESSAGE_BYTES
BATCH_OVERHEAD = 61 + 20  # a v2 batch's header, and at most this much framing for its one record
PRODUCE_VERSION = 9  # what kafka-python 3.0.12 negotiates with Tansu (confluent-kafka 2.16: 10)


@pytest.fixture
def cfg() -> KafkaConfig:
    """Clients that would send records well over the broker's limit (the sinks' own check is what is bypassed)."""
    return KafkaConfig(partitions=1, max_record_bytes=4 * LIMIT)


@pytest.fixture
def topic(cfg, bootstrap, topic_prefix) -> str:
    name = f"{topic_prefix}-limits"
    admin = connect(cfg, bootstrap).admin()
    admin.create_topics([name], partitions=2)
    admin.close()
    return name


def test_the_shared_broker_enforces_the_limit(broker):
    assert broker.max_message_bytes == LIMIT


def test_kafka_python_gets_message_too_large_over_the_limit_and_succeeds_under_it(cfg, bootstrap, broker, topic):
    sink = connect(cfg, bootstrap).sink()
    try:
        under = sink.send(topic, os.urandom(LIMIT - BATCH_OVERHEAD), partition=0, check_size=False).get(timeout=60)
        assert under.offset == 0
        refused_before = broker.proxy.refused
        # The value alone is within the limit; its batch (header and record framing) is not, as Kafka counts.
        with pytest.raises(TransportError, match="MessageSizeTooLarge.*exceeds the maximum configured value of "
                                                 f"{LIMIT}"):
            sink.send(topic, os.urandom(LIMIT), partition=0, check_size=False).get(timeout=60)
        assert broker.proxy.refused > refused_before
        # No send after the refusal: kafka-python 3.0.12 makes an idempotent producer (rft's sink) fatal on any
        # error it cannot retry, MESSAGE_TOO_LARGE included, and fails every later send; the sink's own check
        # (kafka.max_record_bytes within the broker's limit) is what keeps rft from meeting it.
    finally:
        sink.close()


def test_the_defaults_fit_a_default_broker(bootstrap, topic):
    """kafka.max_record_bytes (default) against Kafka's default message.max.bytes: the largest record rft's sink
    accepts, and a burst of records that kafka-python batches together, are all written (a refusal would make the
    producer fatal for good: the test above)."""
    default = KafkaConfig(partitions=1)
    sink = connect(default, bootstrap).sink(linger_ms=50)
    try:
        largest = default.max_record_bytes - len(b"k")
        futures = [sink.send(topic, os.urandom(largest), key=b"k", partition=0)]
        futures += [sink.send(topic, os.urandom(300_000), partition=0) for _ in range(7)]  # lingered into batches
        sink.flush()
        assert [f.get(timeout=60).offset for f in futures] == list(range(8))
    finally:
        sink.close()


def test_confluent_kafka_gets_the_same_error_code(bootstrap, broker, topic):
    import confluent_kafka

    # The client's own limit is raised, so the refusal can only be the broker's.
    producer = confluent_kafka.Producer({"bootstrap.servers": bootstrap, "message.max.bytes": 4 * LIMIT,
                                         "linger.ms": 0, "acks": "all"})
    outcome: dict[str, object] = {}
    refused_before = broker.proxy.refused
    producer.produce(topic, os.urandom(LIMIT), partition=1, on_delivery=lambda e, m: outcome.update(big=e))
    producer.flush(60)
    producer.produce(topic, os.urandom(LIMIT - BATCH_OVERHEAD), partition=1,
                     on_delivery=lambda e, m: outcome.update(small=e, offset=m.offset()))
    producer.flush(60)
    big = outcome["big"]
    assert isinstance(big, confluent_kafka.KafkaError) and big.code() == confluent_kafka.KafkaError.MSG_SIZE_TOO_LARGE
    assert big.code() == 10 and outcome["small"] is None and outcome["offset"] == 0
    assert broker.proxy.refused > refused_before


def test_consumer_groups_commits_and_fetches_work_through_the_proxy(cfg, bootstrap, topic):
    transport = connect(dataclasses.replace(cfg, session_timeout_ms=6000, max_poll_interval_ms=5000), bootstrap)
    sink = transport.sink()
    for i in range(6):
        sink.send(topic, f"r{i}".encode(), partition=i % 2).get(timeout=60)
    sink.close()
    group = f"{topic}-group"
    source = transport.source(group=group, topics=[topic])
    try:
        seen: list[bytes] = []
        wait_until(lambda: seen.extend(m.value for m in source.poll(0.5)) or len(seen) >= 6, timeout=60,
                   what="the six records through a consumer group")
        assert sorted(seen) == [f"r{i}".encode() for i in range(6)]
        source.commit()
        assert source.committed(topic) == {f"{topic}:0": 3, f"{topic}:1": 3}
    finally:
        source.close()
    again = transport.source(group=group)
    try:
        assert again.committed(topic) == {f"{topic}:0": 3, f"{topic}:1": 3}
    finally:
        again.close()


def batch(value: bytes) -> bytes:
    builder = MemoryRecordsBuilder(magic=2, compression_type=0, batch_size=len(value) + 1024)
    builder.append(0, None, value, [])
    builder.close()
    return bytes(builder.buffer())


def produce_frame(correlation_id: int, partitions: dict[str, dict[int, bytes]], acks: int = -1) -> bytes:
    Topic = ProduceRequest.TopicProduceData
    request = ProduceRequest[PRODUCE_VERSION](transactional_id=None, acks=acks, timeout_ms=30000, topic_data=[
        Topic(name=name, partition_data=[Topic.PartitionProduceData(index=i, records=batch(v)) for i, v in p.items()])
        for name, p in partitions.items()])
    request.with_header(correlation_id=correlation_id, client_id="rft-limits-test")
    return bytes(request.encode(header=True, framed=True))


def read_frame(sock: socket.socket) -> bytes:
    def exactly(n: int) -> bytes:
        data = b""
        while len(data) < n:
            chunk = sock.recv(n - len(data))
            if not chunk:
                raise ConnectionError("the proxy closed the connection")
            data += chunk
        return data

    return exactly(struct.unpack(">i", exactly(4))[0])


def read_response(sock: socket.socket):
    return ProduceResponse[PRODUCE_VERSION].decode(read_frame(sock), header=True)


def slow_fetch_frame(correlation_id: int, topic: str, partition: int, wait_ms: int) -> bytes:
    """A Fetch of an empty partition that asks for more bytes than there are: the broker answers after `wait_ms`."""
    Topic = FetchRequest.FetchTopic
    request = FetchRequest[4](replica_id=-1, max_wait_ms=wait_ms, min_bytes=1 << 20, max_bytes=1 << 20,
                              isolation_level=0, topics=[Topic(topic=topic, partitions=[
                                  Topic.FetchPartition(partition=partition, fetch_offset=0,
                                                       partition_max_bytes=1 << 20)])])
    request.with_header(correlation_id=correlation_id, client_id="rft-limits-test")
    return bytes(request.encode(header=True, framed=True))


def partition_answers(response) -> dict[tuple[str, int], tuple[int, int]]:
    return {(t.name, p.index): (p.error_code, p.base_offset) for t in response.responses
            for p in t.partition_responses}


def raw_connection(bootstrap: str) -> socket.socket:
    host, port = bootstrap.rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=60)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def test_pipelined_requests_are_answered_in_order_with_a_refusal_among_them(bootstrap, topic):
    """A Fetch the broker holds for a second, twenty small produce requests, one over the limit, twenty more, all
    written before any answer is read: the proxy's own answer (ready at once) waits behind the broker's, and every
    answer carries its own correlation id, in request order."""
    sizes = [10] * 20 + [LIMIT] + [10] * 20
    with raw_connection(bootstrap) as sock:
        sock.sendall(slow_fetch_frame(99, topic, 1, wait_ms=1000) + b"".join(
            produce_frame(100 + i, {topic: {0: os.urandom(n)}}) for i, n in enumerate(sizes)))
        fetched = read_frame(sock)
        responses = [read_response(sock) for _ in sizes]
    assert struct.unpack_from(">i", fetched)[0] == 99
    assert [r.header.correlation_id for r in responses] == [100 + i for i in range(len(sizes))]
    answers = [partition_answers(r)[(topic, 0)] for r in responses]
    assert answers[20] == (10, -1)
    written = answers[:20] + answers[21:]
    assert all(code == 0 for code, _ in written), written
    assert [offset for _, offset in written] == list(range(40))


def test_a_request_with_a_small_and_an_oversize_partition_writes_the_small_one(cfg, bootstrap, topic):
    with raw_connection(bootstrap) as sock:
        sock.sendall(produce_frame(7, {topic: {0: b"small", 1: os.urandom(LIMIT)}}))
        response = read_response(sock)
    assert response.header.correlation_id == 7
    assert partition_answers(response) == {(topic, 0): (0, 0), (topic, 1): (10, -1)}
    source = connect(cfg, bootstrap).source()
    try:
        assert source.end_offsets(topic) == {f"{topic}:0": 1, f"{topic}:1": 0}
        source.assign([topic])
        source.seek({f"{topic}:0": 0, f"{topic}:1": 0})
        got = wait_until(lambda: source.poll(0.5), timeout=30, what="the small record")
        assert [m.value for m in got] == [b"small"]
    finally:
        source.close()


def test_an_acks_0_request_over_the_limit_closes_the_connection(bootstrap, topic):
    with raw_connection(bootstrap) as sock:
        sock.sendall(produce_frame(1, {topic: {0: os.urandom(LIMIT)}}, acks=0))
        assert sock.recv(1) == b""  # Kafka's answer to a failed acks=0 produce: the connection closes


def test_rft_broker_serves_the_limit_from_the_command_line(tmp_path):
    port = free_port()
    log = tmp_path / "broker.out"
    with open(log, "w") as out:
        server = subprocess.Popen([sys.executable, "-m", "rft.cli", "broker", "--port", str(port),
                                   "--max-message-bytes", "5000"], cwd=REPO, stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_until(lambda: "listening" in log.read_text(), timeout=60, what="`rft broker` listening",
                   alive=[server], context=log.read_text)
        assert "record batches over 5000 bytes refused" in log.read_text()
        with raw_connection(f"127.0.0.1:{port}") as sock:
            sock.sendall(produce_frame(3, {"cli-limits": {0: os.urandom(6000)}}))
            assert partition_answers(read_response(sock)) == {("cli-limits", 0): (10, -1)}
    finally:
        server.terminate()
        assert server.wait(30) == 0
    refused = subprocess.run([sys.executable, "-m", "rft.cli", "broker", "--max-message-bytes", "0"], cwd=REPO,
                             capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2 and "--max-message-bytes must be a positive number of bytes" in refused.stderr


def test_a_durable_broker_keeps_its_limit_across_a_crash(tmp_path):
    """kill() takes the proxy down with the broker (its port is free again) and start() brings both back on the same
    address, the limit enforced and the acknowledged record there."""
    broker = LocalBroker(data_dir=tmp_path / "data", max_message_bytes=5000).start()
    try:
        address = broker.bootstrap_servers
        with raw_connection(address) as sock:
            sock.sendall(produce_frame(1, {"durable-limits": {0: b"kept"}}))
            assert partition_answers(read_response(sock)) == {("durable-limits", 0): (0, 0)}
        broker.kill()
        assert broker.proxy is None and not broker.alive()
        with pytest.raises(OSError):
            raw_connection(address).close()
        broker.start()
        assert broker.bootstrap_servers == address and broker.alive()
        with raw_connection(address) as sock:
            sock.sendall(produce_frame(2, {"durable-limits": {0: os.urandom(6000)}}) +
                         produce_frame(3, {"durable-limits": {0: b"next"}}))
            assert partition_answers(read_response(sock)) == {("durable-limits", 0): (10, -1)}
            assert partition_answers(read_response(sock)) == {("durable-limits", 0): (0, 1)}
    finally:
        broker.stop()
