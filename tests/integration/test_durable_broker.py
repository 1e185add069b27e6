"""The durable local broker (`LocalBroker(data_dir=...)`: Tansu on rft.broker.objects), real processes over TCP:

- records the broker acknowledged and a committed group offset survive a SIGKILL of both its processes: a restart
  on the same directory serves every record exactly once at its offset, the same committed offsets, the same port,
  and appends after them;
- the process that started it SIGKILLed (as a killed `rft run`): its broker processes die with it, or, when they
  were started from another thread and so outlive it, the next broker on the directory kills them first;
- bad directories and ports get one clear error line (also from `rft broker --data`);
- the end of a topic (`end_offsets` of rft's Kafka transport) is every acknowledged record's, after a restart too,
  whichever batch object Tansu wrote last: its ListOffsets answer names that one;
- a source reading from sought offsets never passes over a batch that is not readable yet (Tansu writes a batch
  after advancing the watermark), unless it stays missing for HOLE_WAIT_S.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from kafka import KafkaAdminClient, KafkaConsumer, KafkaProducer, TopicPartition
from kafka.admin import NewTopic
from kafka.structs import OffsetAndMetadata

from rft.broker.local import BrokerError, LocalBroker
from rft.processes import alive
from rft.transport import connect
from rft.transport.config import KafkaConfig
from tests.waiting import wait_until

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
TOPIC, GROUP, RECORDS = "durable", "durable-group", 300


def produce(bootstrap: str, start: int, count: int, create: bool = False) -> dict[tuple[int, int], bytes]:
    """`count` records acknowledged by the broker (acks=all, each one waited for): (partition, offset) -> value."""
    if create:
        admin = KafkaAdminClient(bootstrap_servers=bootstrap)
        admin.create_topics([NewTopic(TOPIC, 2, 1)])
        admin.close()
    producer = KafkaProducer(bootstrap_servers=bootstrap, acks="all", linger_ms=5)
    futures = {i: producer.send(TOPIC, f"record-{i}".encode(), partition=i % 2) for i in range(start, start + count)}
    acked = {}
    for i, future in futures.items():
        meta = future.get(timeout=30)
        acked[(meta.partition, meta.offset)] = f"record-{i}".encode()
    producer.close()
    return acked


def read_all(bootstrap: str) -> dict[tuple[int, int], bytes]:
    consumer = KafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False)
    partitions = [TopicPartition(TOPIC, p) for p in (0, 1)]
    consumer.assign(partitions)
    consumer.seek_to_beginning()
    source = connect(KafkaConfig(bootstrap_servers=bootstrap)).source()  # the true end (the last test below)
    ends = source.end_offsets(TOPIC)
    source.close()
    end = {tp: ends[f"{TOPIC}:{tp.partition}"] for tp in partitions}
    seen = {}

    def take() -> None:
        for tp, messages in consumer.poll(timeout_ms=1000).items():
            for m in messages:
                assert (tp.partition, m.offset) not in seen, f"offset {m.offset} of {tp} read twice"
                seen[(tp.partition, m.offset)] = m.value

    wait_until(lambda: all(consumer.position(tp) >= end[tp] for tp in partitions), timeout=60, between=take,
               what=f"every record up to the end offsets {end}", context=lambda: f"read {len(seen)} records")
    consumer.close()
    return seen


def commit(bootstrap: str, offsets: dict[int, int]) -> None:
    consumer = KafkaConsumer(bootstrap_servers=bootstrap, group_id=GROUP, enable_auto_commit=False)
    consumer.commit({TopicPartition(TOPIC, p): OffsetAndMetadata(o, "", -1) for p, o in offsets.items()})
    consumer.close()


def committed(bootstrap: str) -> dict[int, int | None]:
    consumer = KafkaConsumer(bootstrap_servers=bootstrap, group_id=GROUP, enable_auto_commit=False)
    try:
        return {p: consumer.committed(TopicPartition(TOPIC, p)) for p in (0, 1)}
    finally:
        consumer.close()


def test_acknowledged_records_and_committed_offsets_survive_kill_9_of_both_processes(tmp_path):
    broker = LocalBroker(data_dir=tmp_path / "data", log_path=tmp_path / "broker.log").start()
    try:
        address = broker.bootstrap_servers
        acked = produce(address, 0, RECORDS, create=True)
        assert len(acked) == RECORDS
        commit(address, {0: 123, 1: 45})
        pids = broker.pids()
        assert len(pids) == 2

        broker.kill()
        assert not any(alive(pid) for pid in pids) and not broker.alive()
        broker.start()
        assert broker.bootstrap_servers == address  # same port: clients' bootstrap stays valid

        assert read_all(address) == acked  # every acknowledged record, once, at its offset
        assert committed(address) == {0: 123, 1: 45}
        more = produce(address, RECORDS, 20)  # appends after them, overwriting nothing
        assert min(o for p, o in more if p == 0) == RECORDS // 2
        assert read_all(address) == {**acked, **more}
    finally:
        broker.stop()
    assert not any(alive(pid) for pid in pids + broker.pids())


def one_batch_each(bootstrap: str, topic: str, count: int, data_dir: Path) -> Path:
    """A new one-partition `topic` of `count` records `record-<i>`, each send waited for (so one batch, and one
    object in the durable broker's store, each); returns the directory of those objects."""
    admin = KafkaAdminClient(bootstrap_servers=bootstrap)
    admin.create_topics([NewTopic(topic, 1, 1)])
    admin.close()
    producer = KafkaProducer(bootstrap_servers=bootstrap, acks="all", linger_ms=0)
    for i in range(count):
        producer.send(topic, f"record-{i}".encode(), partition=0).get(timeout=30)
    producer.close()
    return next((data_dir / "objects").rglob(f"topics/{topic}/partitions/0000000000/records"))


def test_a_topic_ends_after_its_last_acknowledged_record_whichever_batch_was_written_last(tmp_path):
    """Tansu's ListOffsets (latest) answers with the base offset + 1 of the batch object modified last. Produce
    requests in flight together can finish their writes out of order, and the object server lists modification
    times to the millisecond, so that batch need not be the last one: rft read the end from there by reading on
    until a 50 ms poll came back empty, which a slow fetch ended early (Tansu lists the partition's objects on every
    fetch) and a resumed `rft run` counted 7985 of its 8000 tasks and published 15 again. Here a batch in the middle
    is made the newest object (its file's mtime: the out-of-order finish cannot be produced on demand; the broker,
    its object server and every record are real); the end must still be the last acknowledged record's, read from
    the fetch response's high watermark, after a SIGKILL and restart too, and a replay must read every record."""
    broker = LocalBroker(data_dir=tmp_path / "data", log_path=tmp_path / "broker.log").start()
    try:
        address = broker.bootstrap_servers
        records = one_batch_each(address, "batches", 150, tmp_path / "data")
        objects = sorted(records.glob("*.batch"))
        assert len(objects) == 150
        newest = time.time() + 60
        os.utime(objects[10], (newest, newest))  # batch 10 (offset 10) finished its write last
        tp = TopicPartition("batches", 0)
        consumer = KafkaConsumer(bootstrap_servers=address)
        assert consumer.end_offsets([tp]) == {tp: 11}  # the fault is in effect: the broker names batch 10
        consumer.close()

        for restarted in (False, True):
            if restarted:
                broker.kill()
                broker.start()
            source = connect(KafkaConfig(bootstrap_servers=address)).source()
            try:
                assert source.end_offsets("batches") == {"batches:0": 150}, f"restarted={restarted}"
                values = [m.value for m in source.read_range("batches")]
            finally:
                source.close()
            assert values == [f"record-{i}".encode() for i in range(150)]
    finally:
        broker.stop()


def test_a_batch_not_readable_yet_is_waited_for_not_passed_over(tmp_path, monkeypatch, caplog):
    """Tansu advances a partition's watermark, then writes the batch: with two producers on one partition, a later
    batch can be listed while an earlier one is still being written, and a fetch at the earlier offset answers with
    the later one, which kafka-python hands out (the trainer would never train the group in between). The write in
    progress is made by moving batch 5's object out of the listing (it cannot be timed on demand; the broker, its
    object server and the records are real): the source must hand out 0-4, then nothing, and 5-9 once it is back;
    a batch that never comes back is passed over after HOLE_WAIT_S, with a warning naming the offsets, and a read
    bounded by the end (`read_range`) ends at a tail that never comes (a SIGKILL between the two writes: an e2e run
    once stalled on one in its control topic)."""
    import rft.transport.kafka as kafka_transport

    broker = LocalBroker(data_dir=tmp_path / "data", log_path=tmp_path / "broker.log").start()
    try:
        address = broker.bootstrap_servers
        records = one_batch_each(address, "holes", 10, tmp_path / "data")
        batch5, aside = records / f"{5:020d}.batch", tmp_path / "batch5"
        batch5.rename(aside)

        source = connect(KafkaConfig(bootstrap_servers=address)).source()
        try:
            source.assign(["holes"])
            source.seek({"holes:0": 0})
            got = []
            wait_until(lambda: len(got) >= 5, timeout=30, between=lambda: got.extend(source.poll(timeout_s=0.5)),
                       what="records 0-4")
            for _ in range(6):  # a test of absence: kafka-python has the batches past the hole after one fetch
                got.extend(source.poll(timeout_s=0.5))
            assert [m.offset for m in got] == [0, 1, 2, 3, 4]
            aside.rename(batch5)  # the write finishes
            wait_until(lambda: len(got) >= 10, timeout=30, between=lambda: got.extend(source.poll(timeout_s=0.5)),
                       what="records 5-9")
            assert [m.value for m in got] == [f"record-{i}".encode() for i in range(10)]

            monkeypatch.setattr(kafka_transport, "HOLE_WAIT_S", 1.0)
            batch5.rename(aside)  # now for good: a write that failed after the watermark moved
            source.seek({"holes:0": 0})
            got = []
            with caplog.at_level("WARNING", logger="rft.transport.kafka"):
                wait_until(lambda: len(got) >= 9, timeout=30,
                           between=lambda: got.extend(source.poll(timeout_s=0.5)), what="records past the hole")
            assert [m.offset for m in got] == [0, 1, 2, 3, 4, 6, 7, 8, 9]
            assert "holes:0: offsets 5 to 5 never became readable" in caplog.text

            # a tail a SIGKILL cut off (the watermark moved, the batch never written): a bounded read ends there
            (records / f"{9:020d}.batch").rename(tmp_path / "batch9")
            with caplog.at_level("WARNING", logger="rft.transport.kafka"):
                read = list(source.read_range("holes", idle_timeout_s=4.0))
            assert [m.offset for m in read] == [0, 1, 2, 3, 4, 6, 7, 8]
            assert "holes:0: offsets 9 to 9 never became readable" in caplog.text
        finally:
            source.close()
    finally:
        broker.stop()


def test_the_tail_benchmark_reads_back_the_last_records_of_a_long_partition(tmp_path):
    """`rft bench transport --durable --tail-batches N` (docs/operations.md, "Long partitions"): N batches, its end
    and its last 10 records read back as sent (it raises otherwise)."""
    from benchmarks.transport import tail_read

    result = tail_read(40, KafkaConfig(), data_dir=tmp_path / "data")
    assert result["batches"] == 40 and result["tail"] == 10
    assert all(result[k] > 0 for k in ("produce_s", "end_offsets_s", "tail_read_s"))
    objects = list((tmp_path / "data" / "objects").rglob("*/topics/bench-tail-40/partitions/*/records/*.batch"))
    assert len(objects) == 40  # one object per batch: what makes a partition long for Tansu


OWNER = textwrap.dedent("""
    import sys, threading, time
    from rft.broker.local import LocalBroker
    broker = LocalBroker(data_dir=sys.argv[1])
    if sys.argv[2] == "thread":  # started from a thread: no parent-death signal, its processes outlive this one
        t = threading.Thread(target=broker.start); t.start(); t.join()
    else:
        broker.start()
    print(broker.port, *broker.pids(), flush=True)
    time.sleep(600)
""")


@pytest.mark.parametrize("started_from", ["main", "thread"])
def test_a_killed_owner_leaves_no_second_writer_behind(tmp_path, started_from):
    data = tmp_path / "data"
    owner = subprocess.Popen([sys.executable, "-c", OWNER, str(data), started_from], cwd=REPO, text=True,
                             stdout=subprocess.PIPE, env=dict(os.environ, PYTHONPATH=str(REPO)))
    port, *pids = map(int, owner.stdout.readline().split())
    acked = produce(f"127.0.0.1:{port}", 0, 40, create=True)
    owner.send_signal(signal.SIGKILL)
    owner.wait()
    if started_from == "main":  # the parent-death signal ends them (a loaded machine delivers it late)
        wait_until(lambda: not any(alive(pid) for pid in pids), timeout=10, what="the dead owner's broker to end")
    else:
        time.sleep(0.5)  # a test of absence: nothing ends them
        assert any(alive(pid) for pid in pids)

    broker = LocalBroker(data_dir=data).start()  # kills what the dead owner left running on the directory
    try:
        assert not any(alive(pid) for pid in pids)
        assert broker.port == port
        assert read_all(broker.bootstrap_servers) == acked
    finally:
        broker.stop()


def test_bad_data_directories_and_ports_get_one_clear_error(tmp_path):
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("")
    with pytest.raises(BrokerError, match="is not a writable directory"):
        LocalBroker(data_dir=not_a_dir).start()
    with pytest.raises(BrokerError, match="is not a writable directory"):
        LocalBroker(data_dir=not_a_dir / "sub").start()

    with LocalBroker(data_dir=tmp_path / "data") as first:
        with pytest.raises(BrokerError, match="in use by another running broker"):
            LocalBroker(data_dir=tmp_path / "data").start()
        with pytest.raises(BrokerError, match=f"port {first.port} .* is in use"):
            LocalBroker(port=first.port, data_dir=tmp_path / "other").start()
        with pytest.raises(BrokerError, match=f"port {first.port} .* is in use"):
            LocalBroker(port=first.port).start()

    done = subprocess.run([sys.executable, "-m", "rft.cli", "broker", "--data", str(not_a_dir)], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 1
    assert done.stderr.strip().splitlines() == [f"rft broker: broker data directory {not_a_dir} is not a writable "
                                                "directory: File exists"]
