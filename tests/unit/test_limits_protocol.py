"""rft.broker.limits' Kafka protocol code, checked against kafka-python's own encoders and decoders (an independent
implementation of the same JSON schemas) for every Produce version both parse: requests parse and re-frame
byte for byte, the proxy's answers decode as the version's ProduceResponse, refusals merge into a broker's answer.
The proxy on a real broker: tests/integration/test_broker_limits.py."""
from __future__ import annotations

import struct
import uuid

import pytest
from kafka.protocol.producer import ProduceRequest, ProduceResponse
from kafka.record.memory_records import MemoryRecordsBuilder

from rft.broker import limits

VERSIONS = range(3, limits.MAX_PRODUCE_VERSION + 1)  # kafka-python's ProduceRequest starts at v3
Topic = ProduceRequest.TopicProduceData
Part = Topic.PartitionProduceData
TopicAnswer = ProduceResponse.TopicProduceResponse
PartAnswer = TopicAnswer.PartitionProduceResponse


def batch(value_bytes: int) -> bytes:
    """One v2 record batch of one record with a value of `value_bytes` bytes."""
    builder = MemoryRecordsBuilder(magic=2, compression_type=0, batch_size=value_bytes + 1024)
    builder.append(0, None, b"v" * value_bytes, [])
    builder.close()
    return bytes(builder.buffer())


def topic_names(version: int, name: str) -> dict:
    return {"topic_id": uuid.uuid5(uuid.NAMESPACE_DNS, name)} if version >= 13 else {"name": name}


def request(version: int, partitions: dict[str, dict[int, bytes]], *, acks: int = -1, cid: int = 7) -> bytes:
    r = ProduceRequest[version](transactional_id=None, acks=acks, timeout_ms=1000, topic_data=[
        Topic(**topic_names(version, name), partition_data=[Part(index=i, records=rec) for i, rec in parts.items()])
        for name, parts in partitions.items()])
    r.with_header(correlation_id=cid, client_id="rft-test")
    return bytes(r.encode(header=True))


def decode_response(version: int, payload: bytes):
    return ProduceResponse[version].decode(payload, header=True)


def answers(response) -> dict[int, tuple[int, int]]:
    """partition index -> (error code, base offset) over every topic of a decoded response."""
    return {p.index: (p.error_code, p.base_offset) for t in response.responses for p in t.partition_responses}


@pytest.mark.parametrize("version", VERSIONS)
def test_a_produce_request_parses_and_reframes_byte_for_byte(version):
    records = batch(300) + batch(700)  # two batches in one partition: the larger counts
    payload = request(version, {"a": {0: batch(10), 3: records}}, acks=1)
    parsed = limits.parse_produce(payload)
    assert (parsed.version, parsed.correlation_id, parsed.acks) == (version, 7, 1)
    assert limits.produce_acks(payload) == 1
    [topic] = parsed.topics
    assert [(p.index, p.largest_batch) for p in topic.partitions] == [(0, len(batch(10))), (3, len(batch(700)))]
    assert parsed.encode(parsed.topics) == payload


def test_a_batch_counts_its_offset_and_length_prefix_as_kafka_does():
    one = batch(100)
    assert limits.batch_sizes(memoryview(one + one)) == [len(one), len(one)]
    assert len(one) == 12 + struct.unpack_from(">i", one, 8)[0]


@pytest.mark.parametrize("version", VERSIONS)
def test_a_request_within_the_limit_goes_to_the_broker_unchanged(version):
    payload = request(version, {"a": {0: batch(500), 1: batch(900)}})
    limit = len(batch(900))  # exactly the largest batch: accepted, as Kafka accepts size == message.max.bytes
    for verdict in (limits.judge(payload, limit), limits.judge(payload, None), limits.judge(payload, 1 << 30)):
        assert verdict.payload is payload and verdict.expects_response
        assert verdict.answer is None and verdict.transform is None and not verdict.close


@pytest.mark.parametrize("version", VERSIONS)
def test_a_request_whose_every_batch_is_over_the_limit_is_answered_message_too_large(version):
    payload = request(version, {"a": {0: batch(2000), 2: batch(3000)}, "b": {1: batch(2000)}}, cid=42)
    verdict = limits.judge(payload, 1000)
    assert verdict.payload is None and verdict.answer is not None and not verdict.close
    response = decode_response(version, verdict.answer)
    assert response.header.correlation_id == 42
    assert answers(response) == {0: (10, -1), 2: (10, -1), 1: (10, -1)}
    if version >= 8:
        message = response.responses[0].partition_responses[0].error_message
        assert "exceeds the maximum configured value of 1000" in message


@pytest.mark.parametrize("version", VERSIONS)
def test_a_mixed_request_forwards_the_partitions_within_the_limit_and_merges_the_refusals(version):
    payload = request(version, {"a": {0: batch(10), 1: batch(2000)}, "b": {5: batch(2000)}}, cid=9)
    verdict = limits.judge(payload, 1000)
    assert verdict.payload is not None and verdict.transform is not None and verdict.answer is None
    forwarded = ProduceRequest[version].decode(verdict.payload, header=True)
    assert forwarded.header.correlation_id == 9
    assert [(t.name if version < 13 else t.topic_id, [p.index for p in t.partition_data])
            for t in forwarded.topic_data] == [("a" if version < 13 else uuid.uuid5(uuid.NAMESPACE_DNS, "a"), [0])]
    assert bytes(forwarded.topic_data[0].partition_data[0].records) == batch(10)
    # The broker's answer for partition 0 (with a tagged field from v10 on), then the merge.
    part = {"current_leader": PartAnswer.LeaderIdAndEpoch(leader_id=1, leader_epoch=3)} if version >= 10 else {}
    broker = ProduceResponse[version](throttle_time_ms=5, responses=[TopicAnswer(
        **topic_names(version, "a"), partition_responses=[PartAnswer(index=0, error_code=0, base_offset=17, **part)])])
    broker.with_header(correlation_id=9)
    merged = decode_response(version, verdict.transform(bytes(broker.encode(header=True))))
    assert merged.header.correlation_id == 9 and merged.throttle_time_ms == 5
    assert answers(merged) == {0: (0, 17), 1: (10, -1), 5: (10, -1)}
    if version >= 10:
        assert merged.responses[0].partition_responses[0].current_leader.leader_epoch == 3


def test_an_acks_0_request_over_the_limit_closes_the_connection_as_kafka_does():
    verdict = limits.judge(request(9, {"a": {0: batch(10), 1: batch(2000)}}, acks=0), 1000)
    assert verdict.close and not verdict.expects_response and verdict.payload is not None
    assert not limits.judge(request(9, {"a": {0: batch(10)}}, acks=0), 1000).expects_response


def test_other_requests_pass_untouched_and_bad_produce_requests_are_refused():
    metadata = struct.pack(">hhih", 3, 12, 1, -1) + b"\x00" * 5000
    assert limits.judge(metadata, 1000).payload is metadata
    payload = request(9, {"a": {0: batch(2000)}})
    with pytest.raises(limits.ProtocolError, match="version 14 is not parsed"):
        limits.judge(payload[:2] + struct.pack(">h", 14) + payload[4:], 1000)
    with pytest.raises(limits.ProtocolError, match="frame ends"):
        limits.judge(payload[:-30], 1000)
    with pytest.raises(limits.ProtocolError, match="past its end"):
        limits.judge(payload + b"\x00\x00", 1000)
