"""`rft bench transport`: produce and consume throughput of experience records through a real broker.

Starts a local broker (`rft.broker.local.LocalBroker`), then for two record sizes (about 20 KB and 1 MB:
real `ExperienceGroup`s encoded with `rft.schema`, sized by their response length) measures

- kafka-python through `rft.transport` (`RecordSink` / `RecordSource`, the code the system runs), and
- confluent-kafka (librdkafka) with equivalent settings, as the reference, when it is importable,

each producing into a fresh topic and then consuming that topic from the beginning; the clients take
turns `--repeat` times and the fastest run of each is reported (the machine may be shared). MB are
10^6 bytes of record values; produce time runs from the first `send` until `flush` returns (every
record acknowledged), consume time from the first poll until the last record arrived. Records are
encoded before the clock starts: this measures the transport, not msgpack.

`--durable`: the same against the durable local broker (`LocalBroker(data_dir=...)`: Tansu on rft.broker.objects, every
object fsynced before it is acknowledged), its data in a temporary directory under the current one (or `--data
DIR`), removed afterwards; compare with a run without it (the in-memory broker).

`--tail-batches N`: instead, a long partition: N records sent one at a time (each acknowledged before the next, so
N batches; Tansu keeps each as one object) into a one-partition topic, then the seconds to learn its end
(`end_offsets`) and to read its last 10 records from a fresh source, as a consumer at the tail of a long run's topic
does (Tansu lists every batch object of the partition on each fetch).

`--sizes`: instead, experience groups of 1k, 16k and 32k-token responses, with and without MoE routing maps, sent
inline against claim-checked through a local broker that refuses batches over 1,000,000 bytes, produced and consumed
as the explorer and the trainer do (benchmarks/transport_sizes.py says what and how); `--quick`: 1k and 16k only, a
few groups each (seconds).
"""
from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from benchmarks import transport_sizes
from rft.broker.local import LocalBroker
from rft.schema import ExperienceGroup, Sample, encode
from rft.transport import connect
from rft.transport.config import KafkaConfig

SAMPLES_PER_GROUP = 8
PROMPT_TOKENS = 64
BYTES_PER_RESPONSE_TOKEN = 4 + 4 + 1  # int32 token + float32 logprob + uint8 mask
GROUP_FRAMING_BYTES, SAMPLE_FRAMING_BYTES = 200, 130  # msgpack keys and scalars around the arrays
SIZES = {"20KB": 20_000, "1MB": 1_000_000}
TARGET_CONSUME_MB_S = 100.0  # kafka-python consume, each size
TARGET_RATIO = 3.0  # kafka-python within this factor of confluent-kafka, each size and direction
LARGE_RECORD_SHARE = 20  # the 1 MB case sends records/20 records: a similar volume of data


@dataclass
class Result:
    size: str
    client: str
    records: int
    record_bytes: int
    produce_mb_s: float
    produce_records_s: float
    consume_mb_s: float
    consume_records_s: float


Payload = tuple[bytes, bytes, list[tuple[str, bytes]]]  # key, value, headers


def experience_payloads(target_bytes: int, count: int, *, seed: int = 0) -> list[Payload]:
    """`count` encoded experience groups of about `target_bytes` each (the response length sets the size)."""
    rng = np.random.default_rng(seed)
    per_sample = (target_bytes - GROUP_FRAMING_BYTES) // SAMPLES_PER_GROUP - SAMPLE_FRAMING_BYTES - 4 * PROMPT_TOKENS
    response_len = max(1, per_sample // BYTES_PER_RESPONSE_TOKEN)
    prompt = rng.integers(0, 32000, PROMPT_TOKENS, dtype=np.int32)
    payloads = []
    for i in range(count):
        samples = [Sample(sample_index=j, prompt_tokens=prompt,
                          response_tokens=rng.integers(0, 32000, response_len, dtype=np.int32),
                          logprobs=rng.normal(-1.0, 0.5, response_len).astype(np.float32),
                          loss_mask=np.ones(response_len, np.uint8), reward=float(j % 2),
                          finish_reason="length") for j in range(SAMPLES_PER_GROUP)]
        group = ExperienceGroup(run_id="bench", task_id=f"task-{i}", group_id=f"bench/task-{i}/e0", attempt=0,
                                explorer_id="bench-explorer", policy_version=0, samples=samples)
        value, headers = encode(group)
        payloads.append((group.group_id.encode(), value, headers))
    return payloads


# --------------------------------------------------------------------------------------------------
# kafka-python through rft.transport


def kafka_python_produce(cfg: KafkaConfig, bootstrap: str, topic: str, payloads: list[Payload]) -> float:
    sink = connect(cfg, bootstrap).sink(client_id="bench")
    try:
        start = time.perf_counter()
        for key, value, headers in payloads:
            sink.send(topic, value, key=key, headers=headers)
        sink.flush()
        return time.perf_counter() - start
    finally:
        sink.close()


def consume_until(count: int, poll: Callable[[], int], *, what: str, stall_s: float = 30.0) -> float:
    """Seconds until `poll()` (returning how many records it got) has delivered `count` records."""
    seen, start = 0, time.perf_counter()
    last_progress = start
    while seen < count:
        got = poll()
        now = time.perf_counter()
        if got:
            seen, last_progress = seen + got, now
        elif now - last_progress > stall_s:
            raise RuntimeError(f"{what}: {seen} of {count} records arrived, then nothing for {stall_s:.0f} s")
    return time.perf_counter() - start


def kafka_python_consume(cfg: KafkaConfig, bootstrap: str, topic: str, count: int) -> float:
    source = connect(cfg, bootstrap).source(client_id="bench")
    try:
        source.assign([topic])
        source.seek_to_beginning()
        return consume_until(count, lambda: sum(1 for m in source.poll(timeout_s=1.0) if len(m.value)),
                             what=f"kafka-python consuming {topic}")
    finally:
        source.close()


# --------------------------------------------------------------------------------------------------
# confluent-kafka (librdkafka), the reference


def confluent_produce(cfg: KafkaConfig, bootstrap: str, topic: str, payloads: list[Payload]) -> float:
    from confluent_kafka import KafkaException, Producer

    errors: list[str] = []
    producer = Producer({"bootstrap.servers": bootstrap, "acks": "all", "enable.idempotence": True,
                         "linger.ms": 5, "batch.size": 1 << 20, "message.max.bytes": cfg.max_record_bytes + (1 << 16),
                         "queue.buffering.max.kbytes": 1 << 20})

    def delivered(err, _msg):
        if err is not None:
            errors.append(str(err))

    start = time.perf_counter()
    for key, value, headers in payloads:
        while True:
            try:
                producer.produce(topic, value=value, key=key, headers=headers, on_delivery=delivered)
                break
            except BufferError:  # local queue full: let deliveries drain
                producer.poll(0.05)
        producer.poll(0)
    if producer.flush(60) or errors:
        raise KafkaException(f"confluent-kafka produce failed: {errors[:3] or 'flush timed out'}")
    return time.perf_counter() - start


def confluent_consume(cfg: KafkaConfig, bootstrap: str, topic: str, count: int, partitions: int) -> float:
    from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaException, TopicPartition

    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"bench-{topic}", "enable.auto.commit": False,
                         "fetch.max.bytes": max(50 << 20, cfg.max_record_bytes + (1 << 16)),
                         "max.partition.fetch.bytes": cfg.max_record_bytes + (1 << 16)})
    def poll() -> int:
        got = 0
        for msg in consumer.consume(num_messages=1000, timeout=1.0):
            if msg.error():
                raise KafkaException(msg.error())
            got += 1 if len(msg.value()) else 0
        return got

    try:
        consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in range(partitions)])
        return consume_until(count, poll, what=f"confluent-kafka consuming {topic}")
    finally:
        consumer.close()


def confluent_available() -> bool:
    try:
        import confluent_kafka  # noqa: F401
    except ImportError:
        return False
    return True


# --------------------------------------------------------------------------------------------------


def produce_then_consume(client: str, topic: str, payloads: list[Payload], *, cfg: KafkaConfig,
                         bootstrap: str) -> tuple[float, float]:
    """Seconds to produce `payloads` into the (new) `topic`, then to consume them all from its beginning."""
    if client == "kafka-python":
        return (kafka_python_produce(cfg, bootstrap, topic, payloads),
                kafka_python_consume(cfg, bootstrap, topic, len(payloads)))
    return (confluent_produce(cfg, bootstrap, topic, payloads),
            confluent_consume(cfg, bootstrap, topic, len(payloads), cfg.partitions))


def best_result(client: str, size: str, payloads: list[Payload], timings: list[tuple[float, float]]) -> Result:
    """Throughput from the fastest of the repeats (the one least disturbed by other load on the machine)."""
    volume_mb, n = sum(len(v) for _, v, _ in payloads) / 1e6, len(payloads)
    produce_s, consume_s = min(t[0] for t in timings), min(t[1] for t in timings)
    return Result(size=size, client=client, records=n, record_bytes=len(payloads[0][1]),
                  produce_mb_s=volume_mb / produce_s, produce_records_s=n / produce_s,
                  consume_mb_s=volume_mb / consume_s, consume_records_s=n / consume_s)


def run_benchmark(clients: list[str], counts: dict[str, int], repeats: int, cfg: KafkaConfig,
                  data_dir: str | Path | None = None) -> list[Result]:
    """One local broker (durable on `data_dir` when given); per size, the clients take turns `repeats` times, each
    with a fresh topic."""
    results = []
    with LocalBroker(data_dir=data_dir) as broker:
        admin = connect(cfg, broker.bootstrap_servers).admin()
        try:
            for size, target in SIZES.items():
                payloads = experience_payloads(target, counts[size])
                timings: dict[str, list[tuple[float, float]]] = {c: [] for c in clients}
                for repeat in range(repeats):
                    for client in clients:
                        topic = f"bench-{client}-{size}-{repeat}"
                        admin.create_topics([topic])
                        timings[client].append(produce_then_consume(client, topic, payloads, cfg=cfg,
                                                                    bootstrap=broker.bootstrap_servers))
                        admin.delete_topics([topic])  # the broker would keep every copy
                results += [best_result(c, size, payloads, timings[c]) for c in clients]
        finally:
            admin.close()
    return results


def tail_read(batches: int, cfg: KafkaConfig, data_dir: str | Path | None = None, tail: int = 10) -> dict:
    """`--tail-batches` (module docstring): {"batches", "produce_s", "end_offsets_s", "tail_read_s", "tail"}."""
    topic = f"bench-tail-{batches}"
    with LocalBroker(data_dir=data_dir) as broker:
        bootstrap = broker.bootstrap_servers
        admin = connect(cfg, bootstrap).admin()
        admin.create_topics([topic], partitions=1)
        admin.close()
        sink = connect(cfg, bootstrap).sink(client_id="bench")
        started = time.perf_counter()
        try:
            for i in range(batches):
                sink.send(topic, f"record {i}".encode(), partition=0).get(timeout=60)
                if (i + 1) % 5000 == 0:
                    print(f"  {i + 1} of {batches} batches sent", flush=True)
        finally:
            sink.close()
        produce_s = time.perf_counter() - started
        source = connect(cfg, bootstrap).source(client_id="bench")
        try:
            started = time.perf_counter()
            end = source.end_offsets(topic)[f"{topic}:0"]
            end_s = time.perf_counter() - started
            if end != batches:
                raise RuntimeError(f"{topic} ends at {end}, not at the {batches} records sent")
            started = time.perf_counter()
            read = list(source.read_offsets({f"{topic}:0": end - tail}, {f"{topic}:0": end}, idle_timeout_s=60))
            tail_s = time.perf_counter() - started
        finally:
            source.close()
    if [m.value for m in read] != [f"record {i}".encode() for i in range(batches - tail, batches)]:
        raise RuntimeError(f"the last {tail} records of {topic} did not read back as sent")
    return {"batches": batches, "produce_s": produce_s, "end_offsets_s": end_s, "tail_read_s": tail_s, "tail": tail}


def ratios(results: list[Result]) -> dict[str, dict[str, float]]:
    """confluent-kafka / kafka-python throughput per size and direction (>1: librdkafka is faster)."""
    by = {(r.size, r.client): r for r in results}
    out = {}
    for size in SIZES:
        ours, ref = by.get((size, "kafka-python")), by.get((size, "confluent-kafka"))
        if ours and ref:
            out[size] = {"produce": ref.produce_mb_s / ours.produce_mb_s,
                         "consume": ref.consume_mb_s / ours.consume_mb_s}
    return out


def targets(results: list[Result], ratio: dict[str, dict[str, float]]) -> dict[str, bool | None]:
    """Whether kafka-python met the targets (None: not measured)."""
    ours = [r for r in results if r.client == "kafka-python"]
    return {f"kafka_python_consume_ge_{TARGET_CONSUME_MB_S:.0f}_mb_s": all(r.consume_mb_s >= TARGET_CONSUME_MB_S
                                                                            for r in ours),
            f"within_{TARGET_RATIO:.0f}x_of_confluent_kafka": all(v <= TARGET_RATIO for rr in ratio.values()
                                                                  for v in rr.values()) if ratio else None}


def print_table(results: list[Result], ratio: dict[str, dict[str, float]]) -> None:
    print(f"{'size':<6} {'client':<16} {'records':>7} {'bytes/rec':>9} {'produce MB/s':>12} {'rec/s':>8} "
          f"{'consume MB/s':>12} {'rec/s':>8}")
    for r in results:
        print(f"{r.size:<6} {r.client:<16} {r.records:>7} {r.record_bytes:>9} {r.produce_mb_s:>12.1f} "
              f"{r.produce_records_s:>8.0f} {r.consume_mb_s:>12.1f} {r.consume_records_s:>8.0f}")
    for size, rr in ratio.items():
        print(f"{size}: confluent-kafka / kafka-python = {rr['produce']:.2f}x produce, {rr['consume']:.2f}x consume")
    print("targets: " + ", ".join(f"{name}={'n/a' if met is None else ('yes' if met else 'NO')}"
                                  for name, met in targets(results, ratio).items()))


def size_study(*, quick: bool, as_json: bool) -> int:
    """`--sizes`: the table (or one JSON object) of benchmarks/transport_sizes.py's cells."""
    cfg = KafkaConfig()
    if quick:
        results = transport_sizes.run_study(transport_sizes.QUICK_TOKENS, volume_mb=5, least=1, most=20, cfg=cfg)
    else:
        results = transport_sizes.run_study(cfg=cfg)
    if as_json:
        print(json.dumps({"unit": "MB = 1e6 bytes of groups (their inline encoding); store MB: its objects",
                          "broker_limit": transport_sizes.BROKER_LIMIT, "compression": cfg.compression,
                          "claim_threshold_bytes": transport_sizes.THRESHOLD, "cells": [asdict(r) for r in results]}))
        return 0
    print(f"local broker refusing batches over {transport_sizes.BROKER_LIMIT} bytes; kafka.compression="
          f"{cfg.compression}; claim-check threshold {transport_sizes.THRESHOLD} bytes, a directory store")
    print(transport_sizes.HEADER)
    for r in results:
        print(transport_sizes.format_row(r))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="rft bench transport", description=__doc__.split("\n\n")[0])
    parser.add_argument("--records", type=int, default=3000,
                        help=f"number of 20 KB records (the 1 MB case sends records/{LARGE_RECORD_SHARE})")
    parser.add_argument("--repeat", type=int, default=2, help="runs per measurement; the fastest is reported")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    parser.add_argument("--no-reference", action="store_true", help="skip confluent-kafka even if installed")
    parser.add_argument("--durable", action="store_true", help="the durable local broker instead of the in-memory "
                        "one (its data in a temporary directory here, or --data)")
    parser.add_argument("--data", default=None, metavar="DIR", help="--durable: keep the broker data in DIR (kept)")
    parser.add_argument("--tail-batches", type=int, default=0, metavar="N",
                        help="measure reading the tail of a one-partition topic of N one-record batches instead")
    parser.add_argument("--sizes", action="store_true", help="the size study instead: groups of 1k-32k tokens, with "
                        "and without routing maps, inline against claim-checked, on a broker with a 1 MB limit")
    parser.add_argument("--quick", action="store_true", help="--sizes: 1k and 16k tokens, a few groups (seconds)")
    args = parser.parse_args(argv)
    if args.quick and not args.sizes:
        parser.error("--quick goes with --sizes")
    if args.sizes:
        return size_study(quick=args.quick, as_json=args.json)
    if args.tail_batches < 0 or 0 < args.tail_batches < 10:
        parser.error(f"--tail-batches must be 0 (off) or at least 10, got {args.tail_batches}")
    if args.records < LARGE_RECORD_SHARE:
        parser.error(f"--records must be at least {LARGE_RECORD_SHARE}")
    clients = ["kafka-python"] + (["confluent-kafka"] if confluent_available() and not args.no_reference else [])
    counts = {"20KB": args.records, "1MB": args.records // LARGE_RECORD_SHARE}
    data_dir = (args.data or tempfile.mkdtemp(prefix=".bench-broker-", dir=".")) if args.durable else None
    broker = "durable" if args.durable else "memory"
    if args.tail_batches:
        try:
            result = {"broker": broker, **tail_read(args.tail_batches, KafkaConfig(), data_dir=data_dir)}
        finally:
            if data_dir is not None and args.data is None:
                shutil.rmtree(data_dir, ignore_errors=True)
        print(json.dumps(result) if args.json else
              f"broker {broker}: {result['batches']} batches sent in {result['produce_s']:.1f} s; end_offsets "
              f"{result['end_offsets_s']:.2f} s; the last {result['tail']} records read in "
              f"{result['tail_read_s']:.2f} s")
        return 0
    try:
        results = run_benchmark(clients, counts, max(1, args.repeat), KafkaConfig(partitions=4), data_dir=data_dir)
    finally:
        if data_dir is not None and args.data is None:
            shutil.rmtree(data_dir, ignore_errors=True)
    ratio = ratios(results)
    if args.json:
        print(json.dumps({"unit": "MB = 1e6 bytes of record values", "broker": broker,
                          "results": [asdict(r) for r in results],
                          "ratio_confluent_over_kafka_python": ratio, "targets_met": targets(results, ratio)}))
    else:
        print(f"broker: local Tansu, {'durable (rft.broker.objects, fsync)' if args.durable else 'in memory'}")
        print_table(results, ratio)
        if "confluent-kafka" not in clients:
            print("confluent-kafka not measured (not installed, or --no-reference)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
