"""rft.transport and `rft topics` against the real local broker over TCP: produce/consume, consumer-group
rebalance and commits, replay by offsets and time, dead-letter routing, the producer-side size limit, export ->
import -> export reproducing a topic exactly, and kcat (an independent Kafka client) reading what rft wrote."""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import msgpack
import pytest

from rft.ops.topics.cli import main as topics
from rft.schema import HEADER_ERROR, ExperienceGroup, decode_group, encode
from rft.transport import HEADER_ORIGIN, DeadLetter, RecordTooLarge, connect, offset_key
from rft.transport.config import KafkaConfig
from tests.records import make_group
from tests.waiting import wait_until

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]


def new_topic(cfg: KafkaConfig, bootstrap: str, name: str, partitions: int | None = None) -> str:
    admin = connect(cfg, bootstrap).admin()
    admin.create_topics([name], partitions=partitions)
    admin.close()
    return name


def produce_groups(cfg: KafkaConfig, bootstrap: str, topic: str, groups: list[ExperienceGroup], **send) -> None:
    sink = connect(cfg, bootstrap).sink()
    for g in groups:
        value, headers = encode(g)
        sink.send(topic, value, key=g.group_id, headers=headers, **send)
    sink.flush()
    sink.close()


def read_all(cfg: KafkaConfig, bootstrap: str, topic: str, **bounds) -> list:
    source = connect(cfg, bootstrap).source()
    try:
        return list(source.read_range(topic, **bounds))
    finally:
        source.close()


def test_produce_consume_round_trip(bootstrap, kafka_cfg, topic_prefix):
    topic = new_topic(kafka_cfg, bootstrap, f"{topic_prefix}.experiences")
    groups = [make_group("run", i, policy_version=i % 3) for i in range(20)]
    produce_groups(kafka_cfg, bootstrap, topic, groups)
    messages = read_all(kafka_cfg, bootstrap, topic)
    got = {m.key.decode(): decode_group(m.value, m.headers) for m in messages}
    assert len(messages) == 20 and got == {g.group_id: g for g in groups}
    assert {m.partition for m in messages} == {0, 1}  # keys spread over both partitions
    source = connect(kafka_cfg, bootstrap).source()
    assert source.end_offsets(topic) == {offset_key(topic, p): sum(m.partition == p for m in messages) for p in (0, 1)}
    source.close()


class GroupMember(threading.Thread):
    """One consumer-group member polling in its own thread; commits after every non-empty batch."""

    def __init__(self, cfg, bootstrap, topic, group, name):
        super().__init__(daemon=True, name=name)
        self.source = connect(cfg, bootstrap).source(group=group, topics=[topic], client_id=name)
        self.seen: list[tuple[int, int, str]] = []  # (partition, offset, group id)
        self.assignment: set[int] = set()
        self.stop = threading.Event()
        self.error: BaseException | None = None

    def run(self):
        try:
            while not self.stop.is_set():
                batch = self.source.poll(timeout_s=0.2)
                self.assignment = {tp.partition for tp in self.source.assignment()}
                if batch:
                    self.seen += [(m.partition, m.offset, m.key.decode()) for m in batch]
                    self.source.commit()
        except BaseException as e:  # surfaced by the test
            self.error = e
        finally:
            self.source.close()


def wait_for(condition, timeout_s: float, what: str, members=()):
    """`wait_until(condition)`, failing at once when one of the `members` failed."""
    def met():
        for m in members:
            assert m.error is None, f"{m.name} failed: {m.error!r}"
        return condition()

    return wait_until(met, timeout=timeout_s, what=what, interval=0.05)


def test_rebalance_when_a_second_consumer_joins(bootstrap, kafka_cfg, topic_prefix):
    topic = new_topic(kafka_cfg, bootstrap, f"{topic_prefix}.experiences")
    first = [make_group("run", i) for i in range(10)]
    produce_groups(kafka_cfg, bootstrap, topic, first)
    a = GroupMember(kafka_cfg, bootstrap, topic, f"{topic_prefix}-group", "member-a")
    a.start()
    wait_for(lambda: len(a.seen) == 10, 30, "member a to read the first 10 records", [a])
    assert a.assignment == {0, 1}

    b = GroupMember(kafka_cfg, bootstrap, topic, f"{topic_prefix}-group", "member-b")
    b.start()
    try:
        wait_for(lambda: a.assignment and b.assignment and a.assignment | b.assignment == {0, 1}
                 and not a.assignment & b.assignment, 45, "the group to rebalance over both members", [a, b])
        second = [make_group("run", i) for i in range(10, 30)]
        produce_groups(kafka_cfg, bootstrap, topic, second)
        wait_for(lambda: len(a.seen) + len(b.seen) >= 30, 30, "all 30 records", [a, b])
        time.sleep(0.5)  # a test of absence: a duplicate delivery would show up here
    finally:
        a.stop.set(), b.stop.set()
        a.join(10), b.join(10)
    keys = [k for _, _, k in a.seen + b.seen]
    assert sorted(keys) == sorted(g.group_id for g in first + second)  # nothing lost, nothing twice
    assert {p for p, _, _ in b.seen} <= b.assignment and b.seen  # b got records of its own partitions
    assert {p for p, _, _ in a.seen[10:]} <= a.assignment and a.seen[10:]

    admin = connect(kafka_cfg, bootstrap).admin()
    committed = admin.group_offsets(f"{topic_prefix}-group")
    admin.close()
    source = connect(kafka_cfg, bootstrap).source()
    assert committed == source.end_offsets(topic)
    source.close()


def test_commits_survive_a_consumer_restart(bootstrap, kafka_cfg, topic_prefix):
    topic = new_topic(kafka_cfg, bootstrap, f"{topic_prefix}.experiences")
    groups = [make_group("run", i) for i in range(12)]
    produce_groups(kafka_cfg, bootstrap, topic, groups)
    group = f"{topic_prefix}-trainer"

    before = connect(kafka_cfg, bootstrap).source(group=group, topics=[topic])
    first: list = []
    wait_until(lambda: len(first) >= 5, timeout=30, what="5 records read before the restart",
               between=lambda: first.extend(before.poll(timeout_s=0.5, max_records=5 - len(first))))
    before.commit()
    positions = before.positions()
    before.close()
    assert len(first) == 5

    after = connect(kafka_cfg, bootstrap).source(group=group, topics=[topic])
    rest: list = []
    wait_until(lambda: len(rest) >= 7, timeout=30, what="the other 7 records after the restart",
               between=lambda: rest.extend(after.poll(timeout_s=0.5)))
    assert after.committed(topic) == positions
    after.close()
    assert sorted(m.key.decode() for m in first + rest) == sorted(g.group_id for g in groups)
    for m in rest:  # each partition resumed exactly at its committed offset
        assert m.offset >= positions[m.position]


def test_dead_letter_routing(bootstrap, kafka_cfg, topic_prefix):
    topic = new_topic(kafka_cfg, bootstrap, f"{topic_prefix}.experiences", partitions=1)
    dlq = new_topic(kafka_cfg, bootstrap, f"{topic_prefix}.dead_letter", partitions=1)
    good_before, good_after = make_group("run", 1), make_group("run", 2)
    value, headers = encode(make_group("run", 3))
    body = msgpack.unpackb(value)
    first_sample = body["samples"][0]
    truncated = dict(body, samples=[dict(first_sample, response_tokens=first_sample["response_tokens"][:-2])])
    nan_group = make_group("run", 4)
    nan_group.samples[2].reward = float("nan")
    bad = {  # value, headers, expected reason
        "garbage": (b"\x00\xffnot msgpack at all", headers, "not msgpack"),
        "version": (value, [("rft-schema", b"7"), ("rft-type", b"experience_group")],
                    "schema version '7' is not supported"),
        "truncated": (msgpack.packb(truncated), headers, "samples[0]: response_tokens: 22 bytes is not a whole number"),
        "nan": (encode(nan_group)[0], headers, "samples[2]: reward is NaN or infinite"),
    }
    sink = connect(kafka_cfg, bootstrap).sink()
    sink.send_record(topic, good_before, key=good_before.group_id)
    for name, (v, h, _) in bad.items():
        sink.send(topic, v, key=name, headers=h)
    sink.send_record(topic, good_after, key=good_after.group_id)
    sink.flush()

    source = connect(kafka_cfg, bootstrap).source()  # as the trainer reads: no group, from stored offsets
    source.seek({f"{topic}:0": 0})
    dead = DeadLetter(sink, dlq)
    decoded: list = []
    wait_until(lambda: len(decoded) + dead.count >= 6, timeout=30, what="6 records decoded or dead-lettered",
               between=lambda: decoded.extend(dead.decode(source.poll(timeout_s=0.5), decode_group)))
    source.close()
    sink.flush()
    sink.close()
    assert [g for _, g in decoded] == [good_before, good_after]  # consumption went on past the bad ones
    assert dead.count == 4

    diverted = {m.key.decode(): m for m in read_all(kafka_cfg, bootstrap, dlq)}
    assert sorted(diverted) == sorted(bad)
    for name, (v, h, expected) in bad.items():
        m = diverted[name]
        assert m.value == v  # byte for byte
        assert expected in dict(m.headers)[HEADER_ERROR].decode()
        assert dict(m.headers)[HEADER_ORIGIN].decode().startswith(f"{topic}:0@")
        assert [x for x in m.headers if x[0] not in (HEADER_ERROR, HEADER_ORIGIN)] == h


def test_a_wedged_client_call_in_end_offsets_is_a_transport_error(bootstrap, kafka_cfg, topic_prefix):
    """kafka-python's hang (dpkp/kafka-python#3121, or a call starved on an overloaded machine) surfaces as
    StuckClientError; end_offsets' fetch of the high watermark must turn it into TransportError like every other call,
    which callers (admission, the stall watch) catch and retry. The wedge cannot be produced on demand, so the
    probe consumer's poll is replaced by one that raises it (the only fake here; the broker and topic are real)."""
    from rft.transport import TransportError
    from rft.transport.kafka import StuckClientError

    topic = new_topic(kafka_cfg, bootstrap, f"{topic_prefix}.wedged", partitions=1)
    produce_groups(kafka_cfg, bootstrap, topic, [make_group(topic_prefix, 0)])
    source = connect(kafka_cfg, bootstrap).source()
    try:
        assert source.end_offsets(topic) == {f"{topic}:0": 1}  # the probe consumer exists now

        def wedged(*args, **kwargs):
            raise StuckClientError("kafka-python call wait_for did not complete in 2.0 s (dpkp/kafka-python#3121)")

        source._probe.poll = wedged
        with pytest.raises(TransportError, match=r"end_offsets \(reading the high watermark\): kafka-python call"):
            source.end_offsets(topic)
        del source._probe.poll
        assert source.end_offsets(topic) == {f"{topic}:0": 1}  # usable again: the caller's retry works
    finally:
        source.close()


def test_oversized_record_is_refused_before_sending(bootstrap, topic_prefix):
    cfg = KafkaConfig(partitions=1, max_record_bytes=50_000)
    topic = new_topic(cfg, bootstrap, f"{topic_prefix}.experiences")
    big = make_group("run", 1, n_samples=8, response_len=1000)  # 8 x 1000 x 9 bytes of arrays
    value, headers = encode(big)
    size = len(value) + len(big.group_id) + sum(len(k) + len(v) for k, v in headers)
    sink = connect(cfg, bootstrap).sink()
    with pytest.raises(RecordTooLarge, match=rf"is {size} bytes, over the limit of 50000 bytes"):
        sink.send_record(topic, big, key=big.group_id)
    sink.send_record(topic, make_group("run", 2), key="small")  # the sink still works
    sink.flush()
    sink.close()
    assert [m.key for m in read_all(cfg, bootstrap, topic)] == [b"small"]


# --------------------------------------------------------------------------------------------------
# rft topics


@pytest.fixture
def mixed_topic(bootstrap, kafka_cfg, topic_prefix) -> str:
    """Two partitions: experience groups, a task-less foreign record, a null key, a tombstone, odd headers."""
    topic = new_topic(kafka_cfg, bootstrap, f"{topic_prefix}.experiences")
    sink = connect(kafka_cfg, bootstrap).sink()
    t0 = 1_700_000_000_000
    for i in range(12):
        value, headers = encode(make_group("run", i, policy_version=i))
        sink.send(topic, value, key=f"run/task-{i}/e0", headers=headers, partition=i % 2, timestamp_ms=t0 + i)
    sink.send(topic, b"\x01\x02foreign", key=None, headers=[("x-empty", b""), ("x-bin", b"\xff\x00")], partition=0,
              timestamp_ms=t0 + 100)
    sink.send(topic, None, key=b"\xfe\xffbinary key", partition=1, timestamp_ms=t0 + 101)
    sink.flush()
    sink.close()
    return topic


def run_topics(capsys, *argv) -> tuple[int, str, str]:
    capsys.readouterr()
    code = topics([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def raw_records(cfg, bootstrap, topic):
    return sorted((m.partition, m.offset, m.timestamp_ms, m.key, m.value, m.headers)
                  for m in read_all(cfg, bootstrap, topic))


@pytest.mark.parametrize("suffix", ["jsonl", "parquet"])
def test_export_import_export_is_identical(bootstrap, kafka_cfg, mixed_topic, tmp_path, capsys, suffix):
    first, second = tmp_path / f"first.{suffix}", tmp_path / f"second.{suffix}"
    target = f"{mixed_topic}-copy"
    assert run_topics(capsys, "export", mixed_topic, first, "--bootstrap", bootstrap)[0] == 0
    code, _, err = run_topics(capsys, "import", first, target, "--bootstrap", bootstrap)
    assert code == 0 and "imported 14 records" in err and "note" not in err
    assert run_topics(capsys, "export", target, second, "--bootstrap", bootstrap)[0] == 0
    assert first.read_bytes() == second.read_bytes()
    assert raw_records(kafka_cfg, bootstrap, target) == raw_records(kafka_cfg, bootstrap, mixed_topic)

    code, _, err = run_topics(capsys, "import", first, target, "--bootstrap", bootstrap)
    assert code == 1 and f"topic {target!r} already holds 14 records" in err and "--append" in err
    code, _, err = run_topics(capsys, "import", first, target, "--append", "--bootstrap", bootstrap)
    assert code == 0 and "note: partitions [0, 1] got offsets other than the file's" in err
    assert len(read_all(kafka_cfg, bootstrap, target)) == 28


def test_export_ranges_and_decoded(bootstrap, mixed_topic, tmp_path, capsys, tiny_model):
    out = tmp_path / "range.jsonl"
    code, _, _ = run_topics(capsys, "export", mixed_topic, out, "--from-offset", "0:2", "1:5", "--to-offset", "0:4",
                            "--bootstrap", bootstrap)
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert code == 0 and lines[0] == {"format": "rft-topic-export", "version": 1, "partitions": 2, "decoded": False}
    assert [(r["partition"], r["offset"]) for r in lines[1:]] == [(0, 2), (0, 3), (1, 5), (1, 6)]

    code, _, _ = run_topics(capsys, "export", mixed_topic, out, "--from-time", "2023-11-14T22:13:20.003Z",
                            "--to-time", str(1_700_000_000_007), "--bootstrap", bootstrap)
    assert [(r["partition"], r["offset"]) for r in map(json.loads, out.read_text().splitlines()[1:])] == \
        [(0, 2), (0, 3), (1, 1), (1, 2)]  # records 3..6, stamped t0+3 .. t0+6
    code, _, err = run_topics(capsys, "import", out, f"{mixed_topic}-range", "--bootstrap", bootstrap)
    assert code == 0 and "imported 4 records" in err and "note: partitions [0, 1] got offsets other" in err

    decoded = tmp_path / "decoded.jsonl"
    code, _, _ = run_topics(capsys, "export", mixed_topic, decoded, "--decoded", "--tokenizer", tiny_model,
                            "--bootstrap", bootstrap)
    rows = [json.loads(line) for line in decoded.read_text().splitlines()]
    assert code == 0 and rows[0]["decoded"] is True and len(rows) == 15
    group = make_group("run", 3, policy_version=3)
    row = next(r for r in rows[1:] if r.get("task_id") == "task-3")
    assert row["policy_version"] == 3 and row["rewards"] == [s.reward for s in group.samples]
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(tiny_model)
    assert row["samples"][1]["response"] == tok.decode(group.samples[1].response_tokens.tolist())
    assert any(r.get("error", "").startswith("missing header 'rft-schema'") for r in rows[1:])
    code, _, err = run_topics(capsys, "import", decoded, f"{mixed_topic}-x", "--bootstrap", bootstrap)
    assert code == 1 and "--decoded export" in err and "cannot be imported" in err

    config = tmp_path / "run.yaml"  # tail --decode takes the tokenizer from the config's model
    config.write_text(f"model: {{path: {tiny_model}}}\nkafka: {{bootstrap_servers: '{bootstrap}'}}\n")
    code, out, _ = run_topics(capsys, "tail", mixed_topic, "-n", "4", "--decode", "-c", config)
    last = make_group("run", 11, policy_version=11)
    assert code == 0 and f"rewards: {json.dumps([s.reward for s in last.samples])}" in out
    assert f"response: {tok.decode(last.samples[3].response_tokens.tolist())!r}" in out


def test_topics_errors_are_clear(bootstrap, mixed_topic, tmp_path, capsys):
    code, _, err = run_topics(capsys, "describe", "no-such-topic", "--bootstrap", bootstrap)
    assert code == 1 and "topic 'no-such-topic' does not exist" in err
    code, _, err = run_topics(capsys, "export", "no-such-topic", tmp_path / "x.jsonl", "--bootstrap", bootstrap)
    assert code == 1 and "does not exist" in err
    code, _, err = run_topics(capsys, "export", mixed_topic, tmp_path / "x.csv", "--bootstrap", bootstrap)
    assert code == 1 and "must end in .jsonl or .parquet" in err
    code, _, err = run_topics(capsys, "export", mixed_topic, tmp_path / "x.jsonl", "--from-offset", "7:0",
                              "--bootstrap", bootstrap)
    assert code == 1 and "has partitions 0..1" in err
    code, _, err = run_topics(capsys, "export", mixed_topic, tmp_path / "missing-dir" / "x.jsonl",
                              "--bootstrap", bootstrap)
    assert code == 1 and "No such file or directory" in err

    good = tmp_path / "good.jsonl"
    assert run_topics(capsys, "export", mixed_topic, good, "--bootstrap", bootstrap)[0] == 0
    lines = good.read_text().splitlines()
    broken = tmp_path / "broken.jsonl"
    for lineno, bad_line, expected in [
        (4, '{"partition": 0, "offset": 2,', "not JSON"),
        (3, lines[2].replace('"value": "', '"value": "!!'), "field 'value' is not valid base64"),
        (5, json.dumps({**json.loads(lines[4]), "partition": 9}), "partition 9 is outside the header's 2 partitions"),
        (2, json.dumps({k: v for k, v in json.loads(lines[1]).items() if k != "timestamp_ms"}),
         "missing fields ['timestamp_ms']"),
    ]:
        broken.write_text("\n".join(lines[:lineno - 1] + [bad_line] + lines[lineno:]) + "\n")
        code, _, err = run_topics(capsys, "import", broken, f"{mixed_topic}-broken", "--bootstrap", bootstrap)
        assert code == 1 and f"{broken}:{lineno}: {expected}" in err, err
    admin = connect(KafkaConfig(), bootstrap).admin()
    assert f"{mixed_topic}-broken" not in admin.list_topics()  # nothing was created or sent
    admin.close()

    config = tmp_path / "run.yaml"
    config.write_text(f"model: {{path: {tmp_path}}}\nkafka: {{bootstrap_servers: embedded}}\n")
    code, _, err = run_topics(capsys, "list", "-c", config)
    assert code == 1 and "is 'embedded'" in err and "--bootstrap" in err
    code, out, _ = run_topics(capsys, "list", "-c", config, "--set", f"kafka.bootstrap_servers={bootstrap}", "--json")
    assert code == 0 and mixed_topic in json.loads(out)
    code, _, err = run_topics(capsys, "list")
    assert code == 1 and "--bootstrap HOST:PORT" in err


def test_describe_shows_offsets_and_group_lag(bootstrap, kafka_cfg, mixed_topic, capsys):
    group = connect(kafka_cfg, bootstrap).source(group=f"{mixed_topic}-lagging")
    group.commit({f"{mixed_topic}:0": 2, f"{mixed_topic}:1": 7})
    group.close()
    code, out, _ = run_topics(capsys, "describe", mixed_topic, "--json", "--bootstrap", bootstrap)
    described = json.loads(out)
    assert code == 0 and described["partitions"] == [
        {"partition": 0, "beginning": 0, "end": 7, "records": 7},
        {"partition": 1, "beginning": 0, "end": 7, "records": 7}]
    assert [r for r in described["groups"] if r["group"] == f"{mixed_topic}-lagging"] == [
        {"group": f"{mixed_topic}-lagging", "partition": 0, "committed": 2, "end": 7, "lag": 5},
        {"group": f"{mixed_topic}-lagging", "partition": 1, "committed": 7, "end": 7, "lag": 0}]
    code, out, _ = run_topics(capsys, "describe", mixed_topic, "--bootstrap", bootstrap)
    assert f"topic {mixed_topic}: 2 partitions, 14 records" in out and f"{mixed_topic}-lagging" in out


def test_tail_prints_the_last_records_and_follows(bootstrap, kafka_cfg, mixed_topic, capsys):
    code, out, _ = run_topics(capsys, "tail", mixed_topic, "-n", "3", "--bootstrap", bootstrap)
    blocks = out.strip().split(f"\n{mixed_topic}:")
    assert code == 0 and len(blocks) == 3
    assert "policy_version=11" in blocks[0] and "group_id=run/task-11/e0" in blocks[0]
    assert "rft-schema=1" in blocks[0] and "rft-type=experience_group" in blocks[0]
    assert "x-bin=base64:/wA=" in blocks[1] and "not a valid rft record" in blocks[1]
    assert "key=base64:/v9iaW5hcnkga2V5" in blocks[2]

    follower = subprocess.Popen([sys.executable, "-m", "rft.cli", "topics", "tail", mixed_topic, "-n", "1", "--follow",
                                 "--bootstrap", bootstrap], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                text=True, env=dict(os.environ, PYTHONPATH=str(REPO)))
    watchdog = threading.Timer(60, follower.kill)  # a follower that prints nothing fails the test, not hangs it
    watchdog.start()
    try:
        lines = iter(follower.stdout.readline, "")
        assert f"{mixed_topic}:1@6" in next(lines)  # the last record: it has read up to the end
        produce_groups(kafka_cfg, bootstrap, mixed_topic, [make_group("run", 50, policy_version=50)], partition=0)
        followed = [line for _, line in zip(range(5), lines, strict=False)]  # the next 5 lines of the stream: the
        # rest of 1@6 (2 lines), then 0@7 (3 lines)
        assert f"{mixed_topic}:0@7" in followed[2] and "policy_version=50" in followed[4]
    finally:
        watchdog.cancel()
        follower.send_signal(signal.SIGINT)
        assert follower.wait(10) == 0


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split("."))


@pytest.fixture(scope="module")
def kcat_env(tmp_path_factory) -> dict[str, str]:
    """The environment to run kcat in. Debian bookworm's librdkafka 2.0.2 cannot parse the ApiVersion v3 response
    of the Tansu 0.6 broker ("Protocol read buffer underflow ... ApiVersion v3"), while librdkafka 2.16 can; so
    when the system library is older than the one bundled with confluent-kafka (same soname, librdkafka.so.1),
    kcat is run against the bundled one. kcat itself is the Debian package either way."""
    assert shutil.which("kcat"), "kcat is not installed: apt-get install kcat (`make test` does it)"
    import confluent_kafka

    version_text = subprocess.run(["kcat", "-V"], capture_output=True, text=True).stdout
    found = re.search(r"librdkafka (\d+\.\d+\.\d+)", version_text)
    assert found, "kcat -V did not report its librdkafka version"
    if _version(found.group(1)) >= _version(confluent_kafka.libversion()[0]):
        return dict(os.environ)
    bundled = sorted((Path(confluent_kafka.__file__).parent.parent / "confluent_kafka.libs").glob("librdkafka*.so*"))
    assert bundled, "confluent-kafka's bundled librdkafka was not found"
    libdir = tmp_path_factory.mktemp("librdkafka")
    (libdir / "librdkafka.so.1").symlink_to(bundled[0])
    return dict(os.environ, LD_LIBRARY_PATH=str(libdir))


def test_kcat_reads_what_rft_wrote(bootstrap, kafka_cfg, topic_prefix, kcat_env):
    topic = new_topic(kafka_cfg, bootstrap, f"{topic_prefix}.experiences")
    groups = [make_group("run", i) for i in range(6)]
    produce_groups(kafka_cfg, bootstrap, topic, groups)
    listing = subprocess.run(["kcat", "-C", "-b", bootstrap, "-t", topic, "-e", "-q", "-f", "%p|%o|%k|%S|%h\n"],
                             capture_output=True, text=True, timeout=60, env=kcat_env)
    assert listing.returncode == 0, listing.stderr
    rows = [line.split("|") for line in listing.stdout.splitlines()]
    assert sorted(r[2] for r in rows) == sorted(g.group_id for g in groups)
    sizes = {g.group_id: len(encode(g)[0]) for g in groups}
    for _partition, _offset, key, size, header_text in rows:
        assert int(size) == sizes[key]
        assert set(header_text.split(",")) == {"rft-schema=1", "rft-type=experience_group"}

    partition, offset, key = rows[0][:3]
    one = subprocess.run(["kcat", "-C", "-b", bootstrap, "-t", topic, "-p", partition, "-o", offset, "-c", "1", "-e",
                          "-q", "-f", "%s"], capture_output=True, timeout=60, env=kcat_env)
    assert one.returncode == 0, one.stderr
    group = next(g for g in groups if g.group_id == key)
    assert one.stdout == encode(group)[0]  # kcat's bytes are ours, byte for byte
    assert decode_group(one.stdout) == group
