"""`rft bench compression`'s measuring parts (benchmarks/compression.py): the record batch it sizes is the one
kafka-python builds with the codec (smaller for a compressible group, never for none) and reads back exactly."""
from __future__ import annotations

import pytest

from benchmarks.compression import CODECS, batch_of, codec_costs, payloads, read_batch
from tests.records import make_group


@pytest.mark.parametrize("codec", sorted(CODECS))
def test_a_group_reads_back_from_its_batch(codec):
    item = payloads([make_group("run", 1, n_samples=8, prompt_len=64, response_len=256)])[0]
    batch = batch_of(item, CODECS[codec])
    assert read_batch(batch) == item[1]
    plain = len(batch_of(item, CODECS["none"]))
    assert len(batch) < 0.8 * plain if codec != "none" else len(batch) == plain
    wire, ms = codec_costs([item], CODECS[codec], repeat=1)
    assert wire == len(batch) and ms >= 0
