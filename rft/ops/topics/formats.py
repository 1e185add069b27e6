"""Export files of `rft topics export` / `import` (format `rft-topic-export`, version 1): writers (one
`write(message)` each) and the reader used by import. Byte-exact exports are importable:
- JSONL: line 1 is a header `{"format": "rft-topic-export", "version": 1, "partitions": N, "decoded": false}`,
  then one record per line, partition by partition in offset order:
  `{"partition": P, "offset": O, "timestamp_ms": T, "key": B64|null, "headers": [[NAME, B64|null], ...],
  "value": B64|null}` (B64: standard base64 of the raw bytes).
- Parquet: the same columns with key, value and header values as raw `binary`, and the header as JSON
  in the schema metadata under `rft-topic-export`.
The topic name is not in the file, so export -> import (into any empty topic) -> export reproduces the
file byte for byte whenever the exported offsets were 0, 1, 2, ... in each partition (a whole topic
that never had records deleted). Offsets are assigned by the broker: records imported after others
(`--append`) or exported from the middle of a partition get new offsets, and import says so.
`--decoded` exports are human-readable JSON lines of the decoded records (for inspection and
labelling); their header says `"decoded": true` and import refuses them.
"""
from __future__ import annotations

import base64
import binascii
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rft.ops.topics import TopicsError
from rft.ops.topics.render import decoded_view, json_default
from rft.text.tokens import Detokenizer
from rft.transport import ClaimStore, Message

EXPORT_FORMAT = "rft-topic-export"
EXPORT_VERSION = 1
PARQUET_ROWS_PER_GROUP = 10_000
PARQUET_BYTES_PER_GROUP = 64 << 20


def _b64(data: bytes | None) -> str | None:
    return None if data is None else base64.b64encode(data).decode()


class JsonlExport:
    """Byte-exact JSON lines (see the module docstring)."""

    def __init__(self, path: Path, header: dict[str, Any]):
        self._file = open(path, "w", encoding="utf-8")
        self._file.write(json.dumps(header) + "\n")

    def row(self, m: Message) -> dict[str, Any]:
        return {"partition": m.partition, "offset": m.offset, "timestamp_ms": m.timestamp_ms, "key": _b64(m.key),
                "headers": [[name, _b64(value)] for name, value in m.headers], "value": _b64(m.value)}

    def write(self, m: Message) -> None:
        self._file.write(json.dumps(self.row(m), ensure_ascii=False, default=json_default) + "\n")

    def close(self) -> None:
        self._file.close()


class DecodedJsonlExport(JsonlExport):
    """Human-readable JSON lines of decoded records (not importable)."""

    def __init__(self, path: Path, header: dict[str, Any], detok: Detokenizer, claims: ClaimStore | None = None):
        super().__init__(path, header)
        self.detok, self.claims = detok, claims

    def row(self, m: Message) -> dict[str, Any]:
        return decoded_view(m, self.detok, self.claims)


def parquet_schema():
    import pyarrow as pa

    return pa.schema([("partition", pa.int32()), ("offset", pa.int64()), ("timestamp_ms", pa.int64()),
                      ("key", pa.binary()),
                      ("headers", pa.list_(pa.struct([("key", pa.string()), ("value", pa.binary())]))),
                      ("value", pa.binary())])


class ParquetExport:
    """Byte-exact Parquet, written in row groups of a fixed size (so the same records give the same file)."""

    def __init__(self, path: Path, header: dict[str, Any]):
        import pyarrow.parquet as pq

        self._schema = parquet_schema().with_metadata({EXPORT_FORMAT: json.dumps(header)})
        self._writer = pq.ParquetWriter(str(path), self._schema)
        self._rows: list[dict[str, Any]] = []
        self._bytes = 0

    def write(self, m: Message) -> None:
        self._rows.append({"partition": m.partition, "offset": m.offset, "timestamp_ms": m.timestamp_ms,
                           "key": m.key, "headers": [{"key": k, "value": v} for k, v in m.headers], "value": m.value})
        self._bytes += len(m.value or b"")
        if len(self._rows) >= PARQUET_ROWS_PER_GROUP or self._bytes >= PARQUET_BYTES_PER_GROUP:
            self._flush()

    def _flush(self) -> None:
        import pyarrow as pa

        if self._rows:
            self._writer.write_table(pa.Table.from_pylist(self._rows, schema=self._schema))
        self._rows, self._bytes = [], 0

    def close(self) -> None:
        self._flush()
        self._writer.close()


def export_kind(path: Path, decoded: bool) -> str:
    suffix = path.suffix.lower()
    if suffix not in (".jsonl", ".parquet"):
        raise TopicsError(f"{path}: the output must end in .jsonl or .parquet")
    if decoded and suffix != ".jsonl":
        raise TopicsError(f"{path}: --decoded writes JSON lines; name the output *.jsonl")
    return suffix[1:]


@dataclass(frozen=True)
class ExportedRecord:
    partition: int
    offset: int
    timestamp_ms: int
    key: bytes | None
    value: bytes | None
    headers: list[tuple[str, bytes | None]]

    @property
    def size(self) -> int:
        return len(self.value or b"") + len(self.key or b"") + sum(len(k) + len(v or b"") for k, v in self.headers)


def check_header(header: Any, where: str) -> dict[str, Any]:
    if not isinstance(header, dict) or header.get("format") != EXPORT_FORMAT:
        raise TopicsError(f"{where}: not an `rft topics export` file (the header has no format {EXPORT_FORMAT!r})")
    if header.get("version") != EXPORT_VERSION:
        raise TopicsError(f"{where}: export format version {header.get('version')!r} is not supported "
                          f"(this build reads {EXPORT_VERSION})")
    if header.get("decoded"):
        raise TopicsError(f"{where}: this is a --decoded export (human-readable, not byte-exact) and cannot be "
                          "imported; export again without --decoded")
    partitions = header.get("partitions")
    if not isinstance(partitions, int) or isinstance(partitions, bool) or partitions < 1:
        raise TopicsError(f"{where}: header field 'partitions' must be a positive integer, got {partitions!r}")
    return header


def _unb64(value: Any, field_name: str) -> bytes | None:
    if value is None:
        return None
    if not isinstance(value, str):
        raise ValueError(f"field {field_name!r} must be base64 text or null, got {type(value).__name__}")
    try:
        return base64.b64decode(value, validate=True)
    except binascii.Error:
        raise ValueError(f"field {field_name!r} is not valid base64") from None


_FIELDS = ("partition", "offset", "timestamp_ms", "key", "headers", "value")


def record_from_json(row: Any, partitions: int) -> ExportedRecord:
    if not isinstance(row, dict):
        raise ValueError(f"expected a JSON object, got {type(row).__name__}")
    missing, unknown = [f for f in _FIELDS if f not in row], sorted(set(row) - set(_FIELDS))
    if missing or unknown:
        raise ValueError(f"missing fields {missing}" if missing else f"unknown fields {unknown}")
    headers = row["headers"]
    if not isinstance(headers, list) or not all(isinstance(h, list) and len(h) == 2 and isinstance(h[0], str)
                                                for h in headers):
        raise ValueError("field 'headers' must be a list of [name, base64-or-null] pairs")
    return _checked(ExportedRecord(
        partition=row["partition"], offset=row["offset"], timestamp_ms=row["timestamp_ms"],
        key=_unb64(row["key"], "key"), value=_unb64(row["value"], "value"),
        headers=[(name, _unb64(value, f"headers[{name}]")) for name, value in headers]), partitions)


def _checked(record: ExportedRecord, partitions: int) -> ExportedRecord:
    for name in ("partition", "offset", "timestamp_ms"):
        value = getattr(record, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"field {name!r} must be a non-negative integer, got {value!r}")
    if record.partition >= partitions:
        raise ValueError(f"partition {record.partition} is outside the header's {partitions} partitions")
    for name, value in record.headers:
        if value is None:  # Kafka allows it, but kafka-python cannot produce it
            raise ValueError(f"header {name!r} has a null value, which cannot be imported (kafka-python "
                             "produces header values as bytes only)")
    return record


def read_export(path: Path) -> tuple[dict[str, Any], Iterator[ExportedRecord]]:
    """The header and an iterator over the records of an export file; every malformed line or row
    raises TopicsError naming the file and the line (JSONL) or row (Parquet)."""
    if not path.is_file():
        raise TopicsError(f"{path}: no such file")
    if path.suffix.lower() == ".parquet":
        return _read_parquet(path)
    return _read_jsonl(path)


def _read_jsonl(path: Path) -> tuple[dict[str, Any], Iterator[ExportedRecord]]:
    with open(path, encoding="utf-8") as f:
        first = f.readline()
    try:
        header = check_header(json.loads(first), f"{path}:1")
    except json.JSONDecodeError as e:
        raise TopicsError(f"{path}:1: not JSON ({e.msg}); expected the export header") from None

    def records() -> Iterator[ExportedRecord]:
        with open(path, encoding="utf-8") as f:
            f.readline()
            for lineno, line in enumerate(f, start=2):
                if not line.strip():
                    continue
                try:
                    yield record_from_json(json.loads(line), header["partitions"])
                except json.JSONDecodeError as e:
                    raise TopicsError(f"{path}:{lineno}: not JSON ({e.msg} at column {e.colno})") from None
                except ValueError as e:
                    raise TopicsError(f"{path}:{lineno}: {e}") from None

    return header, records()


def _read_parquet(path: Path) -> tuple[dict[str, Any], Iterator[ExportedRecord]]:
    import pyarrow.parquet as pq

    try:
        pfile = pq.ParquetFile(str(path))
    except Exception as e:  # pyarrow raises ArrowInvalid, OSError, ... for a file that is not Parquet
        raise TopicsError(f"{path}: not a readable Parquet file: {e}") from None
    meta = pfile.schema_arrow.metadata or {}
    if EXPORT_FORMAT.encode() not in meta:
        raise TopicsError(f"{path}: not an `rft topics export` file (no {EXPORT_FORMAT!r} schema metadata)")
    header = check_header(json.loads(meta[EXPORT_FORMAT.encode()]), str(path))
    if not pfile.schema_arrow.remove_metadata().equals(parquet_schema()):
        raise TopicsError(f"{path}: columns are {pfile.schema_arrow.remove_metadata()}, expected {parquet_schema()}")

    def records() -> Iterator[ExportedRecord]:
        row_index = 0
        for batch in pfile.iter_batches(batch_size=1000):
            for row in batch.to_pylist():
                try:
                    yield _checked(ExportedRecord(
                        partition=row["partition"], offset=row["offset"], timestamp_ms=row["timestamp_ms"],
                        key=row["key"], value=row["value"],
                        headers=[(h["key"], h["value"]) for h in row["headers"] or []]), header["partitions"])
                except (ValueError, TypeError) as e:
                    raise TopicsError(f"{path}: row {row_index}: {e}") from None
                row_index += 1

    return header, records()
