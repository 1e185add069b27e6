"""Producer compression through the real local broker (Tansu, durable on a directory): kafka-python 3.0.12 sends
zstd and lz4 record batches (and gzip), the broker accepts them and keeps them compressed (its batch objects are
smaller than the uncompressed ones), and a consumer reads every group back exactly."""
from __future__ import annotations

from pathlib import Path

import pytest

from rft.broker.local import LocalBroker
from rft.schema import decode_group, encode
from rft.transport import connect
from rft.transport.config import KafkaConfig
from tests.records import make_group

pytestmark = pytest.mark.integration


def stored_bytes(data_dir: Path, topic: str) -> int:
    """Bytes of the broker's objects for `topic` (its batches, as the broker keeps them)."""
    return sum(p.stat().st_size for p in data_dir.rglob("*") if p.is_file() and f"/{topic}/" in p.as_posix())


def test_zstd_and_lz4_batches_are_accepted_kept_compressed_and_read_back(tmp_path):
    groups = [make_group("run", i, n_samples=8, prompt_len=64, response_len=256) for i in range(12)]
    stored = {}
    with LocalBroker(data_dir=tmp_path) as broker:
        for codec in (None, "zstd", "lz4", "gzip"):
            cfg = KafkaConfig(partitions=1, compression=codec)
            topic = f"compression-{codec or 'none'}"
            admin = connect(cfg, broker.bootstrap_servers).admin()
            admin.create_topics([topic], partitions=1)
            admin.close()
            sink = connect(cfg, broker.bootstrap_servers).sink()
            for g in groups:  # one batch each: acknowledged before the next
                value, headers = encode(g)
                sink.send(topic, value, key=g.group_id, headers=headers).get(timeout=30)
            sink.close()
            source = connect(KafkaConfig(partitions=1), broker.bootstrap_servers).source()  # consumers need nothing
            try:
                read = list(source.read_range(topic))
            finally:
                source.close()
            assert [decode_group(m.value, m.headers) for m in read] == groups, codec
            stored[codec] = stored_bytes(tmp_path, topic)
    assert stored[None] > 0
    for codec in ("zstd", "lz4", "gzip"):  # random ids and log-probs still compress (int32 ids < 2^15, framing)
        assert stored[codec] < 0.8 * stored[None], stored
