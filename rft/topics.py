"""`rft topics`: list, describe, tail, export and import Kafka topics (an operator tool).

Connection: `--bootstrap HOST:PORT`, or `-c CONFIG [--set key=value]` whose `kafka.bootstrap_servers`
and `kafka.security` are used (`--bootstrap` wins when both are given; the config also names the
tokenizer for `--decode`). `embedded` is refused: an embedded broker lives only inside the run that
started it, so there is nothing for this tool to connect to.

Export files (format `rft-topic-export`, version 1) are byte-exact and importable:
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

import argparse
import base64
import binascii
import json
import sys
from contextlib import closing
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Iterator

from rft.commandline import config_from_args
from rft.config import KafkaConfig
from rft.schema import HEADER_ERROR, ControlMessage, ExperienceGroup, RecordError, TaskRecord, decode
from rft.transport import Admin, Message, RecordSink, RecordSource, TransportError, offset_key, parse_offset_key

EXPORT_FORMAT = "rft-topic-export"
EXPORT_VERSION = 1
PARQUET_ROWS_PER_GROUP = 10_000
PARQUET_BYTES_PER_GROUP = 64 << 20
TOKENS_SHOWN = 32  # token ids printed per array when no tokenizer is given


def create_run_topics(cfg) -> None:
    """Create a run's topics where missing: tasks, control, dead letters (kafka.partitions) and experiences
    (kafka.experience_partitions). `rft run` and `rft publish` call it, so trainers and explorers started on
    their own (Slurm, Ray) find every topic."""
    with closing(Admin(cfg.kafka, cfg.kafka.bootstrap_servers)) as admin:
        admin.create_topics([cfg.topic("tasks"), cfg.topic("control"), cfg.topic("dead_letter")])
        admin.create_topics([cfg.topic("experiences")], partitions=cfg.kafka.experience_partitions)


class TopicsError(Exception):
    """A user-facing error; `main` prints it and returns 1."""


@dataclass(frozen=True)
class Connection:
    kafka: KafkaConfig
    bootstrap: str
    tokenizer_path: str  # "" when neither --tokenizer nor a config names one


def connection_from_args(args: argparse.Namespace) -> Connection:
    if args.config:
        cfg = config_from_args(args)
        kafka, tokenizer = cfg.kafka, cfg.model.tokenizer or cfg.model.path
        bootstrap, where = args.bootstrap or cfg.kafka.bootstrap_servers, f"kafka.bootstrap_servers in {args.config}"
    else:
        if args.overrides:
            raise TopicsError("--set needs a config file (-c CONFIG)")
        if not args.bootstrap:
            raise TopicsError("say which broker: --bootstrap HOST:PORT, or -c CONFIG to use its kafka section")
        kafka, tokenizer, bootstrap, where = KafkaConfig(), "", args.bootstrap, "--bootstrap"
    if bootstrap == "embedded":
        raise TopicsError(f"{where} is 'embedded': an embedded broker exists only inside the run that started it; "
                          "pass --bootstrap HOST:PORT of a running broker (e.g. the address `rft broker` prints)")
    return Connection(kafka=kafka, bootstrap=bootstrap, tokenizer_path=getattr(args, "tokenizer", None) or tokenizer)


def require_topic(admin: Admin, topic: str, bootstrap: str) -> None:
    if topic not in admin.list_topics():
        raise TopicsError(f"topic {topic!r} does not exist on {bootstrap} (`rft topics list` shows those that do)")


# --------------------------------------------------------------------------------------------------
# Views of one message: shared by `tail` (printed) and `export --decoded` (JSON lines).


def iso_time(timestamp_ms: int) -> str:
    return datetime.fromtimestamp(timestamp_ms / 1000, tz=timezone.utc).isoformat(timespec="milliseconds")


def printable(data: bytes | None) -> str | None:
    """Bytes as text when they are UTF-8, else as `base64:...`."""
    if data is None:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return "base64:" + base64.b64encode(data).decode()


def message_view(m: Message) -> dict[str, Any]:
    return {"partition": m.partition, "offset": m.offset, "timestamp_ms": m.timestamp_ms,
            "timestamp": iso_time(m.timestamp_ms), "key": printable(m.key), "size": len(m.value or b""),
            "headers": {name: printable(value) for name, value in m.headers}}


def record_summary(record: TaskRecord | ExperienceGroup | ControlMessage) -> dict[str, Any]:
    """Type, ids and policy version: what identifies a record, without its content."""
    if isinstance(record, ExperienceGroup):
        return {"type": "experience_group", "policy_version": record.policy_version, "group_id": record.group_id,
                "task_id": record.task_id, "run_id": record.run_id, "explorer_id": record.explorer_id,
                "attempt": record.attempt, "n_samples": len(record.samples)}
    if isinstance(record, TaskRecord):
        return {"type": "task", "group_id": record.group_id, "task_id": record.task_id, "run_id": record.run_id,
                "epoch": record.epoch}
    return {"type": "control", "kind": record.kind, "sender": record.sender}


class Detokenizer:
    """Token ids -> text with the model's tokenizer (loaded on first use); without a path, `text` is None."""

    def __init__(self, path: str, *, skip_special_tokens: bool = False):
        self.path, self.skip_special_tokens = path, skip_special_tokens
        self._tokenizer = None

    def text(self, tokens) -> str | None:
        if not self.path:
            return None
        if self._tokenizer is None:
            from transformers import AutoTokenizer
            try:
                self._tokenizer = AutoTokenizer.from_pretrained(self.path)
            except (OSError, ValueError) as e:
                raise TopicsError(f"cannot load a tokenizer from {self.path}: {e}") from None
        return self._tokenizer.decode([int(t) for t in tokens], skip_special_tokens=self.skip_special_tokens)


def _tokens_or_text(name: str, tokens, detok: Detokenizer) -> dict[str, Any]:
    text = detok.text(tokens)
    if text is not None:
        return {name: text}
    return {f"{name}_tokens": [int(t) for t in tokens]}


def record_content(record: TaskRecord | ExperienceGroup | ControlMessage, detok: Detokenizer) -> dict[str, Any]:
    """The human-readable content: prompt/response text (token ids without a tokenizer), rewards."""
    if isinstance(record, TaskRecord):
        return {"prompt": record.prompt, "answer": record.answer, "metadata": record.metadata,
                "created_at": record.created_at}
    if isinstance(record, ControlMessage):
        return {"body": record.body, "created_at": record.created_at}
    samples = []
    for s in record.samples:
        samples.append({
            "sample_index": s.sample_index, "reward": s.reward, "reward_components": s.reward_components,
            "finish_reason": s.finish_reason, "prompt_len": len(s.prompt_tokens),
            "response_len": len(s.response_tokens), "loss_tokens": int(s.loss_mask.sum()),
            "mean_logprob": float(s.logprobs.mean()) if len(s.logprobs) else None,
            **_tokens_or_text("prompt", s.prompt_tokens, detok),
            **_tokens_or_text("response", s.response_tokens, detok), "metadata": s.metadata})
    return {"rewards": [s.reward for s in record.samples], "answer": record.answer, "metadata": record.metadata,
            "created_at": record.created_at, "samples": samples}


def decoded_view(m: Message, detok: Detokenizer) -> dict[str, Any]:
    view = message_view(m)
    try:
        record = decode(m.value, m.headers)
    except RecordError as e:
        return {**view, "error": str(e)}
    return {**view, **record_summary(record), **record_content(record, detok)}


def _json_default(value: Any) -> Any:
    if isinstance(value, (bytes, bytearray)):
        return "base64:" + base64.b64encode(bytes(value)).decode()
    return str(value)


# --------------------------------------------------------------------------------------------------
# list / describe


def cmd_list(args: argparse.Namespace, conn: Connection) -> int:
    with closing(Admin(conn.kafka, conn.bootstrap)) as admin:
        topics = admin.list_topics()
    print(json.dumps(topics) if args.json else "\n".join(topics))
    return 0


def group_lags(admin: Admin, topic: str, ends: dict[int, int]) -> list[dict[str, Any]]:
    """Per group with committed offsets on `topic`, per partition: committed offset, end and lag."""
    rows = []
    for group in admin.groups():
        committed = {parse_offset_key(k).partition: v for k, v in admin.group_offsets(group).items()
                     if parse_offset_key(k).topic == topic and v is not None and v >= 0}
        for partition, offset in sorted(committed.items()):
            end = ends.get(partition, offset)
            rows.append({"group": group, "partition": partition, "committed": offset, "end": end,
                         "lag": max(0, end - offset)})
    return rows


def cmd_describe(args: argparse.Namespace, conn: Connection) -> int:
    with closing(Admin(conn.kafka, conn.bootstrap)) as admin:
        require_topic(admin, args.topic, conn.bootstrap)
        parts = admin.describe(args.topic)
        lags = group_lags(admin, args.topic, {p.partition: p.end for p in parts})
    partitions = [{"partition": p.partition, "beginning": p.beginning, "end": p.end,
                   "records": max(0, p.end - p.beginning)} for p in parts]
    if args.json:
        print(json.dumps({"topic": args.topic, "partitions": partitions, "groups": lags}))
        return 0
    total = sum(p["records"] for p in partitions)
    print(f"topic {args.topic}: {len(partitions)} partitions, {total} records")
    print(f"  {'partition':>9} {'beginning':>10} {'end':>10} {'records':>10}")
    for p in partitions:
        print(f"  {p['partition']:>9} {p['beginning']:>10} {p['end']:>10} {p['records']:>10}")
    if not lags:
        print("no consumer group has committed offsets on this topic")
        return 0
    print("consumer groups (committed offsets):")
    print(f"  {'group':<30} {'partition':>9} {'committed':>10} {'end':>10} {'lag':>8}")
    for row in lags:
        print(f"  {row['group']:<30} {row['partition']:>9} {row['committed']:>10} {row['end']:>10} {row['lag']:>8}")
    return 0


# --------------------------------------------------------------------------------------------------
# tail


def format_message(m: Message, detok: Detokenizer | None) -> str:
    """A few lines per record: position, time, key, size and headers; type, ids and policy version;
    with a detokenizer (`--decode`) also the content."""
    view = message_view(m)
    lines = [f"{m.topic}:{m.partition}@{m.offset}  {view['timestamp']}  key={view['key']}  {view['size']} bytes",
             "  headers: " + (" ".join(f"{k}={v}" for k, v in view["headers"].items()) or "(none)")]
    try:
        record = decode(m.value, m.headers)
    except RecordError as e:
        lines.append(f"  not a valid rft record: {e}")
        if HEADER_ERROR in view["headers"]:
            lines.append(f"  dead-letter reason: {view['headers'][HEADER_ERROR]}")
        return "\n".join(lines)
    lines.append("  " + "  ".join(f"{k}={v}" for k, v in record_summary(record).items()))
    if detok is not None:
        lines += [f"  {line}" for line in _content_lines(record_content(record, detok))]
    return "\n".join(lines)


def _content_lines(content: dict[str, Any]) -> list[str]:
    lines, last_prompt = [], None
    for key, value in content.items():
        if key == "samples":
            for s in value:
                lines.append(f"sample {s['sample_index']}: reward={s['reward']:g} {s['reward_components'] or ''} "
                             f"finish={s['finish_reason']} response_len={s['response_len']} "
                             f"mean_logprob={_fmt(s['mean_logprob'])}")
                prompt = s.get("prompt", s.get("prompt_tokens"))
                parts = ("prompt", "response") if prompt != last_prompt else ("response",)  # GRPO: one prompt
                last_prompt = prompt
                lines += [f"  {line}" for line in _text_lines(s, parts)]
        elif key != "created_at":
            lines.append(f"{key}: {json.dumps(value, ensure_ascii=False, default=_json_default)}")
    return lines


def _fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3f}"


def _text_lines(sample: dict[str, Any], parts: tuple[str, ...]) -> list[str]:
    lines = []
    for part in parts:
        if part in sample:
            lines.append(f"{part}: {sample[part]!r}")
        else:
            ids = sample[f"{part}_tokens"]
            more = f" ... ({len(ids)} tokens; --tokenizer DIR shows text)" if len(ids) > TOKENS_SHOWN else ""
            lines.append(f"{part} tokens: {ids[:TOKENS_SHOWN]}{more}")
    return lines


def last_records(source: RecordSource, topic: str, n: int) -> tuple[list[Message], dict[str, int]]:
    """The last `n` records of the topic by timestamp (ties: partition, offset), and the end offsets."""
    begin, stop = source.replay_bounds(topic)
    start = {k: max(begin[k], stop[k] - n) for k in begin}
    messages = sorted(source.read_offsets(start, stop), key=lambda m: (m.timestamp_ms, m.partition, m.offset))
    return messages[max(0, len(messages) - n):] if n else [], stop


def cmd_tail(args: argparse.Namespace, conn: Connection) -> int:
    with closing(Admin(conn.kafka, conn.bootstrap)) as admin:
        require_topic(admin, args.topic, conn.bootstrap)
    detok = Detokenizer(conn.tokenizer_path) if args.decode else None
    with closing(RecordSource(conn.kafka, conn.bootstrap, client_id="rft-topics")) as source:
        messages, ends = last_records(source, args.topic, args.n)
        for m in messages:
            print(format_message(m, detok), flush=True)
        if args.follow:
            follow(source, args.topic, ends, lambda m: print(format_message(m, detok), flush=True))
    return 0


def follow(source: RecordSource, topic: str, start: dict[str, int], show) -> None:
    """`show` each new record from `start` until Ctrl-C / SIGTERM."""
    import threading

    from rft.commandline import install_stop_signals

    stop = threading.Event()
    install_stop_signals(stop)
    source.assign([topic])
    source.seek(start)
    try:
        while not stop.is_set():
            for m in source.poll(timeout_s=1.0):
                show(m)
    except KeyboardInterrupt:
        pass


# --------------------------------------------------------------------------------------------------
# Export files: writers (one `write(message)` each) and the reader used by import.


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
        self._file.write(json.dumps(self.row(m), ensure_ascii=False, default=_json_default) + "\n")

    def close(self) -> None:
        self._file.close()


class DecodedJsonlExport(JsonlExport):
    """Human-readable JSON lines of decoded records (not importable)."""

    def __init__(self, path: Path, header: dict[str, Any], detok: Detokenizer):
        super().__init__(path, header)
        self.detok = detok

    def row(self, m: Message) -> dict[str, Any]:
        return decoded_view(m, self.detok)


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


# --------------------------------------------------------------------------------------------------
# export / import


def parse_positions(specs: list[str], topic: str, option: str, partitions: int) -> dict[str, int]:
    """`["0:100", "1:250"]` -> {"topic:0": 100, "topic:1": 250}."""
    out = {}
    for spec in specs:
        partition, sep, offset = spec.partition(":")
        if not sep or not partition.isdigit() or not offset.isdigit():
            raise TopicsError(f"{option} expects PARTITION:OFFSET (e.g. 0:100), got {spec!r}")
        if int(partition) >= partitions:
            raise TopicsError(f"{option} {spec}: topic {topic!r} has partitions 0..{partitions - 1}")
        out[offset_key(topic, int(partition))] = int(offset)
    return out


def parse_time_ms(text: str | None, option: str) -> int | None:
    """Milliseconds since the epoch, or ISO 8601 (a time without a zone is UTC)."""
    if text is None:
        return None
    if text.isdigit():
        return int(text)
    try:
        moment = datetime.fromisoformat(text)
    except ValueError:
        raise TopicsError(f"{option} expects ISO 8601 (e.g. 2025-01-31T12:00:00Z) or milliseconds since the "
                          f"epoch, got {text!r}") from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=timezone.utc)
    return int(moment.timestamp() * 1000)


def _progress(total: int, desc: str):
    from tqdm import tqdm

    return tqdm(total=total, unit="rec", desc=desc, file=sys.stderr, dynamic_ncols=True)


def cmd_export(args: argparse.Namespace, conn: Connection) -> int:
    out = Path(args.out)
    kind = export_kind(out, args.decoded)
    with closing(Admin(conn.kafka, conn.bootstrap)) as admin:
        require_topic(admin, args.topic, conn.bootstrap)
    from_time, to_time = parse_time_ms(args.from_time, "--from-time"), parse_time_ms(args.to_time, "--to-time")
    with closing(RecordSource(conn.kafka, conn.bootstrap, client_id="rft-topics")) as source:
        partitions = len(source.partitions(args.topic))
        begin, stop = source.replay_bounds(
            args.topic, start=parse_positions(args.from_offset, args.topic, "--from-offset", partitions),
            end=parse_positions(args.to_offset, args.topic, "--to-offset", partitions),
            from_time_ms=from_time)
        header = {"format": EXPORT_FORMAT, "version": EXPORT_VERSION, "partitions": partitions,
                  "decoded": args.decoded}
        partial = out.with_name(out.name + ".partial")  # renamed when complete: a failed export leaves no OUT
        if args.decoded:
            writer = DecodedJsonlExport(partial, header, Detokenizer(conn.tokenizer_path))
        else:
            writer = JsonlExport(partial, header) if kind == "jsonl" else ParquetExport(partial, header)
        written, total = 0, sum(max(0, stop[k] - begin[k]) for k in begin)
        try:
            with closing(writer), _progress(total, f"export {args.topic}") as bar:
                for key in sorted(begin, key=lambda k: parse_offset_key(k).partition):
                    for m in source.read_offsets({key: begin[key]}, {key: stop[key]}, from_time_ms=from_time,
                                                 to_time_ms=to_time):
                        writer.write(m)
                        written += 1
                        bar.update(1)
        except BaseException:
            partial.unlink(missing_ok=True)
            raise
    partial.replace(out)
    print(f"exported {written} records of {args.topic} ({partitions} partitions) to {out}", file=sys.stderr)
    return 0


@dataclass
class ImportPlan:
    header: dict[str, Any]
    records: int
    first_offsets: dict[int, int]  # partition -> offset of its first record in the file
    largest: int  # bytes of the largest record
    gaps: set[int]  # partitions whose offsets in the file are not consecutive (filtered or compacted)


def scan_export(path: Path, limit: int) -> ImportPlan:
    """Read the whole file once, validating every record, before anything is sent."""
    header, records = read_export(path)
    plan = ImportPlan(header=header, records=0, first_offsets={}, largest=0, gaps=set())
    last: dict[int, int] = {}
    for r in records:
        plan.records += 1
        plan.first_offsets.setdefault(r.partition, r.offset)
        if r.partition in last and r.offset != last[r.partition] + 1:
            plan.gaps.add(r.partition)
        last[r.partition] = r.offset
        plan.largest = max(plan.largest, r.size)
    if plan.largest > limit:
        raise TopicsError(f"{path}: a record of {plan.largest} bytes is over kafka.max_record_bytes={limit}; "
                          "import with -c CONFIG --set kafka.max_record_bytes=N")
    return plan


def prepare_target(conn: Connection, topic: str, plan: ImportPlan, *, append: bool) -> dict[int, int]:
    """Create the topic if missing (with the file's partition count); refuse one with too few partitions,
    or one that holds records unless `append`. Returns its end offsets per partition."""
    with closing(Admin(conn.kafka, conn.bootstrap)) as admin:
        if topic not in admin.list_topics():
            admin.create_topics([topic], partitions=plan.header["partitions"])
    with closing(RecordSource(conn.kafka, conn.bootstrap, client_id="rft-topics")) as source:
        have, need = len(source.partitions(topic)), max(plan.first_offsets, default=-1) + 1
        if have < need:
            raise TopicsError(f"topic {topic!r} has {have} partitions; the file has records for partition {need - 1}")
        begin, stop = source.replay_bounds(topic)
    held = sum(max(0, stop[k] - begin[k]) for k in stop)
    if held and not append:
        raise TopicsError(f"topic {topic!r} already holds {held} records; importing would add after them with "
                          "other offsets than the file's. Import into an empty or new topic, or pass --append")
    return {parse_offset_key(k).partition: v for k, v in stop.items()}


def cmd_import(args: argparse.Namespace, conn: Connection) -> int:
    path = Path(args.file)
    plan = scan_export(path, conn.kafka.max_record_bytes)
    ends = prepare_target(conn, args.topic, plan, append=args.append)
    moved = sorted(plan.gaps | {p for p, first in plan.first_offsets.items() if ends.get(p, 0) != first})
    errors: list[Exception] = []
    sink = RecordSink(conn.kafka, conn.bootstrap, client_id="rft-topics-import")
    with closing(sink), _progress(plan.records, f"import {args.topic}") as bar:
        for r in read_export(path)[1]:
            future = sink.send(args.topic, r.value, key=r.key, headers=r.headers, partition=r.partition,
                               timestamp_ms=r.timestamp_ms, check_size=False)
            future.add_errback(errors.append)
            bar.update(1)
        sink.flush()
    if errors:
        raise TopicsError(f"{len(errors)} of {plan.records} records were not written to {args.topic!r}: {errors[0]}")
    print(f"imported {plan.records} records into {args.topic}", file=sys.stderr)
    if moved:
        print(f"note: partitions {moved} got offsets other than the file's (the broker assigns consecutive offsets "
              "from the topic's end; the file started elsewhere or skips offsets)", file=sys.stderr)
    return 0


# --------------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--bootstrap", metavar="HOST:PORT", help="broker address (overrides the config's)")
    common.add_argument("-c", "--config", metavar="CONFIG", help="run config: bootstrap servers, security, tokenizer")
    common.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config key (with -c)")
    parser = argparse.ArgumentParser(prog="rft topics", description="Inspect, export and import Kafka topics.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="{list,describe,tail,export,import}")

    p = sub.add_parser("list", parents=[common], help="topic names")
    p.add_argument("--json", action="store_true")
    p.set_defaults(handler=cmd_list)

    p = sub.add_parser("describe", parents=[common], help="partitions, offsets, record counts, consumer-group lag")
    p.add_argument("topic")
    p.add_argument("--json", action="store_true")
    p.set_defaults(handler=cmd_describe)

    p = sub.add_parser("tail", parents=[common], help="the last records of a topic")
    p.add_argument("topic")
    p.add_argument("-n", type=int, default=10, help="how many records (default 10)")
    p.add_argument("--follow", "-f", action="store_true", help="keep printing new records until Ctrl-C")
    p.add_argument("--decode", action="store_true", help="show prompt/response text, rewards")
    p.add_argument("--tokenizer", metavar="DIR", help="HF tokenizer directory (default: the config's model)")
    p.set_defaults(handler=cmd_tail)

    p = sub.add_parser("export", parents=[common], help="dump a topic (or a range) to .jsonl or .parquet")
    p.add_argument("topic")
    p.add_argument("out", help="OUT.jsonl or OUT.parquet")
    p.add_argument("--from-offset", nargs="+", default=[], metavar="P:O", help="first offset per partition")
    p.add_argument("--to-offset", nargs="+", default=[], metavar="P:O", help="end offset (exclusive) per partition")
    p.add_argument("--from-time", metavar="ISO|MS", help="only records stamped at or after this time "
                   "(ISO 8601, UTC when no zone is given, or milliseconds since the epoch)")
    p.add_argument("--to-time", metavar="ISO|MS", help="only records stamped before this time")
    p.add_argument("--decoded", action="store_true", help="human-readable decoded records (not importable)")
    p.add_argument("--tokenizer", metavar="DIR", help="with --decoded: HF tokenizer directory for text")
    p.set_defaults(handler=cmd_export)

    p = sub.add_parser("import", parents=[common], help="write an exported file back into a topic")
    p.add_argument("file")
    p.add_argument("topic")
    p.add_argument("--append", action="store_true", help="allow a target topic that already holds records")
    p.set_defaults(handler=cmd_import)
    return parser


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    if getattr(args, "n", 0) < 0:
        print("rft topics: -n must be >= 0", file=sys.stderr)
        return 2
    try:
        return args.handler(args, connection_from_args(args))
    except (TopicsError, TransportError, OSError) as e:  # OSError: files (export/import paths)
        print(f"rft topics {args.command}: {e}", file=sys.stderr)
        return 1
