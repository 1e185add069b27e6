"""A bound on how far a compressed record batch may inflate in a consumer (kafka-python 3.0.12 has no setting for it).

kafka-python decompresses a fetched batch whole (`DefaultRecordBatch._maybe_uncompress`): a batch of a few KB that a
topic writer filled with gzip'd zeros (a "gzip bomb") inflates to gigabytes in every consumer of the topic, and again
after each restart. `install_inflation_bound()` (called when rft.transport.kafka is imported) replaces that method
so that gzip, zstd and lz4 batches inflate into at most MAX_INFLATED_BYTES: a batch that would inflate further raises
`InflatedBatchTooLarge` naming its partition and offsets, instead of inflating, and `KafkaSource.poll` passes over the
batch (every record of it), counts it and logs it. Snappy batches (no snappy codec is installed here) and the legacy
v0/v1 message formats keep kafka-python's own decoding. If kafka-python's internals differ from what this expects
(another version), nothing is replaced and a warning says so. What a fetch may bring compressed is bounded by the
consumer's fetch sizes (rft.transport.kafka).
"""
from __future__ import annotations

import gzip
import io
import logging
from typing import Any

log = logging.getLogger(__name__)

MAX_INFLATED_BYTES = 256 << 20  # the most one record batch may inflate to (8 x the largest fetch of a partition)
_CHUNK = 1 << 20


class InflatedBatchTooLarge(Exception):
    """A compressed record batch that would inflate past MAX_INFLATED_BYTES: offsets `base_offset` to
    `next_offset - 1` of `partition` (a kafka TopicPartition; None until the fetcher names it)."""

    def __init__(self, base_offset: int, next_offset: int, limit: int):
        super().__init__(f"a compressed record batch at offsets {base_offset}..{next_offset - 1} inflates past "
                         f"{limit} bytes")
        self.base_offset, self.next_offset, self.limit = base_offset, next_offset, limit
        self.partition: Any = None


def _read_upto(stream: Any, limit: int) -> bytes:
    """At most `limit` bytes of `stream`, read a chunk at a time."""
    out = bytearray()
    while len(out) < limit:
        chunk = stream.read(min(_CHUNK, limit - len(out)))
        if not chunk:
            break
        out += chunk
    return bytes(out)


def inflate(codec: str, data: bytes | memoryview, limit: int) -> bytes | None:
    """`data` decompressed with `codec` ("gzip", "zstd", "lz4"), at most `limit` + 1 bytes (more than `limit`: the
    batch is over); None for a codec this does not bound."""
    if codec == "gzip":
        with gzip.GzipFile(fileobj=io.BytesIO(data), mode="rb") as f:
            return _read_upto(f, limit + 1)
    if codec == "zstd":
        import zstandard

        with zstandard.ZstdDecompressor().stream_reader(io.BytesIO(data), read_across_frames=True) as reader:
            return _read_upto(reader, limit + 1)
    if codec == "lz4":
        import lz4.frame

        return bytes(lz4.frame.LZ4FrameDecompressor().decompress(bytes(data), max_length=limit + 1))
    return None


def install_inflation_bound() -> bool:
    """Bound kafka-python's batch decompression (module docstring); False (logged) when its internals differ."""
    try:
        from kafka.consumer.fetcher import Fetcher
        from kafka.record.default_records import DefaultRecordBatch

        records_class = Fetcher.PartitionRecords
        original_unpack = records_class._unpack_records
        codecs = {DefaultRecordBatch.CODEC_GZIP: "gzip", DefaultRecordBatch.CODEC_ZSTD: "zstd",
                  DefaultRecordBatch.CODEC_LZ4: "lz4"}
        original_uncompress = DefaultRecordBatch._maybe_uncompress
    except (ImportError, AttributeError) as e:
        log.warning("kafka-python's record batches are not bounded when inflated (%s): a compressed batch inflates "
                    "whole", e)
        return False
    if getattr(original_uncompress, "rft_bounded", False):
        return True

    def bounded_uncompress(batch: Any) -> None:
        codec = codecs.get(batch.compression_type)
        if batch._decompressed or codec is None:
            return original_uncompress(batch)
        batch._assert_has_codec(batch.compression_type)
        limit = MAX_INFLATED_BYTES
        inflated = inflate(codec, memoryview(batch._buffer)[batch._pos:], limit)
        if inflated is None:
            return original_uncompress(batch)
        if len(inflated) > limit:
            raise InflatedBatchTooLarge(batch.base_offset, batch.next_offset, limit)
        batch._buffer, batch._pos, batch._decompressed = bytearray(inflated), 0, True
        return None

    def named_unpack(self: Any, tp: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            yield from original_unpack(self, tp, *args, **kwargs)
        except InflatedBatchTooLarge as e:
            e.partition = tp
            raise

    bounded_uncompress.rft_bounded = True  # type: ignore[attr-defined]
    DefaultRecordBatch._maybe_uncompress = bounded_uncompress
    records_class._unpack_records = named_unpack
    return True
