"""Issue 54, smaller item: a compression bomb from a topic writer (a batch of a few KB that inflates to gigabytes)
no longer inflates whole in the consumer (rft.transport.inflation bounds kafka-python's decompression): on the real
broker, the batch is passed over and counted (`KafkaSource.batches_refused`), the records around it are read, by a
source without a group (the trainer's feed, replays) and by a consumer group's member started afterwards."""
from __future__ import annotations

import pytest

from rft.transport import connect, inflation
from rft.transport.config import KafkaConfig
from tests.waiting import wait_until

pytestmark = [pytest.mark.integration]

LIMIT = 1 << 20  # the bound in this test (the default is 256 MiB)


@pytest.mark.parametrize("codec", ["gzip", "zstd"])
def test_a_compression_bomb_is_passed_over_and_counted(bootstrap, topic_prefix, monkeypatch, codec):
    monkeypatch.setattr(inflation, "MAX_INFLATED_BYTES", LIMIT)
    topic = f"{topic_prefix}.bomb"
    transport = connect(KafkaConfig(partitions=1, compression=codec, max_record_bytes=16 << 20), bootstrap)
    transport.admin().create_topics([topic], partitions=1)
    sink = transport.sink(linger_ms=0)
    for value in (b"before", bytes(8 * LIMIT), b"after"):  # one batch each; the middle one a few KB on the wire
        sink.send(topic, value).get(timeout=30)
    sink.close()

    source = transport.source()
    try:
        read = [m.value for m in source.read_range(topic, idle_timeout_s=3.0)]
        assert read == [b"before", b"after"] and source.batches_refused == 1
    finally:
        source.close()
    member = transport.source(group=f"{topic_prefix}.readers", topics=[topic])  # a consumer started afterwards
    try:
        got: list[bytes] = []
        wait_until(lambda: got.extend(m.value for m in member.poll(timeout_s=0.5)) or len(got) >= 2, timeout=30,
                   interval=0, what="the records around the bomb")
        assert got == [b"before", b"after"] and member.batches_refused == 1
    finally:
        member.close()
