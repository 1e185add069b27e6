"""`rft topics` subcommands: list, describe, tail, export, import (the parser and `main`).

Connection: `--bootstrap HOST:PORT`, or `-c CONFIG [--set key=value]` whose `kafka.bootstrap_servers`
and `kafka.security` are used (`--bootstrap` wins when both are given; the config also names the
tokenizer for `--decode`, and the claim store of claim-checked records: `records.store`, rft/run/records.py;
`--claims STORE` names one without a config). `embedded` is refused (rft.cli.commandline.embedded_broker_error): an
embedded broker lives only inside the run that started it, so there is nothing for this tool to connect to.

Export file formats: rft/ops/topics//formats.py.
"""
from __future__ import annotations

import argparse
import json
import sys
import threading
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

from rft.cli.commandline import EMBEDDED, config_from_args, embedded_broker_error, install_stop_signals
from rft.ops.topics import TopicsError
from rft.ops.topics.formats import (
    EXPORT_FORMAT,
    EXPORT_VERSION,
    DecodedJsonlExport,
    JsonlExport,
    ParquetExport,
    export_kind,
    read_export,
)
from rft.ops.topics.render import format_message
from rft.run.records import claim_store
from rft.text.tokens import Detokenizer, TokenizerError
from rft.transport import (
    Admin,
    BrokerUnreachable,
    ClaimStore,
    Message,
    PositionSpecError,
    RecordSource,
    Transport,
    TransportError,
    connect,
    parse_offset_key,
    parse_positions,
    parse_time_ms,
)
from rft.transport.config import KafkaConfig


@dataclass(frozen=True)
class Connection:
    kafka: KafkaConfig
    bootstrap: str
    tokenizer_path: str  # "" when neither --tokenizer nor a config names one
    transport: Transport  # builds every client of the command
    claims: ClaimStore | None = None  # where tail and export --decoded fetch claim-checked parts (None: listed only)


def connection_from_args(args: argparse.Namespace) -> Connection:
    if args.config:
        cfg = config_from_args(args)
        kafka, tokenizer = cfg.kafka, cfg.model.tokenizer or cfg.model.path
        bootstrap = args.bootstrap or cfg.kafka.bootstrap_servers
        where = "--bootstrap" if args.bootstrap else f"kafka.bootstrap_servers in {args.config}"
        run_dir = cfg.run_dir
        claims = claim_store(cfg)
    else:
        if args.overrides:
            raise TopicsError("--set needs a config file (-c CONFIG)")
        if not args.bootstrap:
            raise TopicsError("say which broker: --bootstrap HOST:PORT, or -c CONFIG to use its kafka section")
        kafka, tokenizer, bootstrap, where = KafkaConfig(), "", args.bootstrap, "--bootstrap"
        run_dir, claims = None, None
    if getattr(args, "claims", None):
        claims = ClaimStore(args.claims)
    if bootstrap == EMBEDDED:
        raise TopicsError(embedded_broker_error("rft topics", where=where, fix="--bootstrap HOST:PORT",
                                                run_dir=run_dir))
    return Connection(kafka=kafka, bootstrap=bootstrap, tokenizer_path=getattr(args, "tokenizer", None) or tokenizer,
                      transport=connect(kafka, bootstrap), claims=claims)


def require_topic(admin: Admin, topic: str, bootstrap: str) -> None:
    if topic not in admin.list_topics():
        raise TopicsError(f"topic {topic!r} does not exist on {bootstrap} (`rft topics list` shows those that do)")


# --------------------------------------------------------------------------------------------------
# list / describe


def cmd_list(args: argparse.Namespace, conn: Connection) -> int:
    with closing(conn.transport.admin()) as admin:
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
    with closing(conn.transport.admin()) as admin:
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



def last_records(source: RecordSource, topic: str, n: int) -> tuple[list[Message], dict[str, int]]:
    """The last `n` records of the topic by timestamp (ties: partition, offset), and the end offsets."""
    begin, stop = source.replay_bounds(topic)
    start = {k: max(begin[k], stop[k] - n) for k in begin}
    messages = sorted(source.read_offsets(start, stop), key=lambda m: (m.timestamp_ms, m.partition, m.offset))
    return messages[max(0, len(messages) - n):] if n else [], stop


def cmd_tail(args: argparse.Namespace, conn: Connection) -> int:
    with closing(conn.transport.admin()) as admin:
        require_topic(admin, args.topic, conn.bootstrap)
    detok = Detokenizer(conn.tokenizer_path) if args.decode else None
    with closing(conn.transport.source(client_id="rft-topics")) as source:
        messages, ends = last_records(source, args.topic, args.n)
        for m in messages:
            print(format_message(m, detok, conn.claims), flush=True)
        if args.follow:
            follow(source, args.topic, ends, lambda m: print(format_message(m, detok, conn.claims), flush=True))
    return 0


def follow(source: RecordSource, topic: str, start: dict[str, int], show) -> None:
    """`show` each new record from `start` until Ctrl-C / SIGTERM."""
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



def _progress(total: int, desc: str):
    from tqdm import tqdm  # loaded only by the commands that show progress

    return tqdm(total=total, unit="rec", desc=desc, file=sys.stderr, dynamic_ncols=True)


def cmd_export(args: argparse.Namespace, conn: Connection) -> int:
    out = Path(args.out)
    kind = export_kind(out, args.decoded)
    with closing(conn.transport.admin()) as admin:
        require_topic(admin, args.topic, conn.bootstrap)
    from_time, to_time = parse_time_ms(args.from_time, "--from-time"), parse_time_ms(args.to_time, "--to-time")
    with closing(conn.transport.source(client_id="rft-topics")) as source:
        partitions = len(source.partitions(args.topic))
        begin, stop = source.replay_bounds(
            args.topic, start=parse_positions(args.from_offset, args.topic, "--from-offset", partitions),
            end=parse_positions(args.to_offset, args.topic, "--to-offset", partitions),
            from_time_ms=from_time)
        header = {"format": EXPORT_FORMAT, "version": EXPORT_VERSION, "partitions": partitions,
                  "decoded": args.decoded}
        partial = out.with_name(out.name + ".partial")  # renamed when complete: a failed export leaves no OUT
        writer: JsonlExport | ParquetExport
        if args.decoded:
            writer = DecodedJsonlExport(partial, header, Detokenizer(conn.tokenizer_path), conn.claims)
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
    with closing(conn.transport.admin()) as admin:
        if topic not in admin.list_topics():
            admin.create_topics([topic], partitions=plan.header["partitions"])
    with closing(conn.transport.source(client_id="rft-topics")) as source:
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
    errors: list[BaseException] = []
    sink = conn.transport.sink(client_id="rft-topics-import")
    with closing(sink), _progress(plan.records, f"import {args.topic}") as bar:
        for r in read_export(path)[1]:
            # a tombstone (no value) or a header without a value passes through as exported: the Kafka client
            # sends None as Kafka's null; rft's own records always have both
            value, headers = cast(bytes, r.value), cast("list[tuple[str, bytes]]", r.headers)
            future = sink.send(args.topic, value, key=r.key, headers=headers, partition=r.partition,
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


CLAIMS_HELP = ("claim store (directory or s3://BUCKET/PREFIX) to fetch claim-checked parts from (default: the "
               "config's records.store; without either the claims are listed, not fetched)")


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
    p.add_argument("--claims", metavar="STORE", help=CLAIMS_HELP)
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
    p.add_argument("--claims", metavar="STORE", help="with --decoded: " + CLAIMS_HELP)
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
    except BrokerUnreachable:
        raise  # one line and exit status 4 from the dispatcher (rft.cli), as for every command
    except (TopicsError, TransportError, PositionSpecError, TokenizerError, OSError) as e:  # OSError: files
        print(f"rft topics {args.command}: {e}", file=sys.stderr)
        return 1
