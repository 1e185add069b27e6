"""Collecting claim-checked parts on the real broker (rft/trainer/collect.py, rft/transport/collect.py), and the claim
store's retries of transient errors against real slow and refusing TCP endpoints in front of a real S3 server.

committed: the trainer's position comes from checkpoint files as the trainer writes them; a reader group in
records.readers holds collection back until it commits; a part shared (by content) with a record nobody has passed
survives; the state file lets the next collection start where the last stopped. retention: objects older than the
retention go, a re-put refreshes an object, `rft records collect --dry-run` deletes nothing."""
from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path

import pytest

from rft.broker.objects import ObjectServer
from rft.broker.slow import SlowProxy
from rft.ops.records import main as records_main
from rft.run.config import Config, load_config
from rft.run.records import claim_store, run_transport
from rft.schema import RecordError
from rft.trainer.collect import STATE_FILE, collect_run
from rft.transport import ClaimStore, claims_in
from rft.transport.claims import ClaimStoreError
from tests.records import make_group
from tests.s3_servers import S3_ENV
from tests.waiting import wait_until

pytestmark = pytest.mark.integration

THRESHOLD = 4096


def run_config(tmp_path: Path, bootstrap: str, prefix: str, *extra: str) -> Config:
    return load_config(None, [f"model.path={tmp_path}", f"run.output_dir={tmp_path}", "run.name=collect",
                              f"kafka.topic_prefix={prefix}",
                              f"kafka.bootstrap_servers={bootstrap}", f"records.claim_threshold_bytes={THRESHOLD}",
                              *extra])


def checkpoint(cfg: Config, step: int, offset: int, *, replay_offsets: tuple[int, ...] = ()) -> None:
    """A trainer checkpoint's state file as the trainer writes it (rft/trainer/checkpoint.py)."""
    topic = cfg.topic("experiences")
    path = cfg.run_dir / "checkpoints" / f"step_{step:06d}"
    path.mkdir(parents=True, exist_ok=True)
    candidates = [{"position": f"{topic}:0", "offset": o, "group_id": f"g{o}", "score": 1.0, "step": 1, "reuse": 0}
                  for o in replay_offsets]
    (path / "trainer_state.json").write_text(json.dumps({"step": step, "feed": {"offsets": {f"{topic}:0": offset}},
                                                         "replay_buffer": {"candidates": candidates}}))


def present(store: ClaimStore, values: list[bytes]) -> list[bool]:
    """Per record value: whether every object it claims is in the store."""
    return [all(store.last_modified(c.sha256) is not None for c in claims_in(v)) for v in values]


def test_committed_collection_waits_for_the_trainer_and_every_reader(bootstrap, topic_prefix, tmp_path):
    cfg = run_config(tmp_path, bootstrap, topic_prefix, "records.collect=committed", "records.readers=[offline]")
    transport = run_transport(cfg)
    topic = cfg.topic("experiences")
    admin = transport.admin()
    admin.create_topics([topic], partitions=1)
    admin.close()
    groups = [make_group("collect", i, n_samples=2, response_len=2000) for i in range(4)]
    groups[3] = dataclasses.replace(groups[1], group_id="shares-its-parts-with-1")  # same payloads as group 1
    sink = transport.sink()
    for g in groups:
        sink.send_record(topic, g, key=g.group_id)
    sink.flush()
    sink.close()
    source = transport.source()
    values = [m.value for m in source.read_range(topic)]
    assert all(claims_in(v) for v in values)
    store = claim_store(cfg)

    def collect():
        return collect_run(cfg, transport, recent_s=0)  # the objects were written just now: rule 3 off

    assert collect().deleted == [] and present(store, values) == [True] * 4  # no checkpoint: nothing passed
    checkpoint(cfg, 1, 2)
    reader = transport.source(group="offline", topics=[topic], from_beginning=False)
    wait_until(lambda: reader.poll(timeout_s=0.5) == [] and reader.assignment(), timeout=60,
               what="the offline reader's partition")
    reader.commit({f"{topic}:0": 1})
    report = collect()  # the trainer passed 0 and 1, the reader only 0
    assert present(store, values) == [False, True, True, True] and report.collected_to == {f"{topic}:0": 1}
    assert json.loads((cfg.run_dir / STATE_FILE).read_text())["offsets"] == {f"{topic}:0": 1}
    reader.commit({f"{topic}:0": 4})
    report = collect()  # both passed 1; its parts are those of record 3, which nobody passed
    assert present(store, values) == [False, True, True, True]
    assert report.kept == {"named by a record not passed": len(claims_in(values[1]))}
    checkpoint(cfg, 2, 4)  # step 1's checkpoint is kept too: it still says 2
    assert collect().deleted == [] and present(store, values) == [False, True, True, True]
    (cfg.run_dir / "checkpoints" / "step_000001" / "trainer_state.json").unlink()  # pruned
    checkpoint(cfg, 2, 4, replay_offsets=(3,))  # the replay buffer may re-read record 3
    collect()
    assert present(store, values) == [False, True, False, True]
    checkpoint(cfg, 2, 4)
    report = collect()
    assert present(store, values) == [False, False, False, False] and report.collected_to == {f"{topic}:0": 4}
    reader.close()
    source.close()


def test_committed_collection_keeps_what_was_just_written(bootstrap, topic_prefix, tmp_path):
    cfg = run_config(tmp_path, bootstrap, topic_prefix, "records.collect=committed")
    transport = run_transport(cfg)
    topic = cfg.topic("experiences")
    admin = transport.admin()
    admin.create_topics([topic], partitions=1)
    admin.close()
    sink = transport.sink()
    g = make_group("collect", 0, n_samples=2, response_len=2000)
    sink.send_record(topic, g, key=g.group_id)
    sink.flush()
    sink.close()
    checkpoint(cfg, 1, 1)
    report = collect_run(cfg, transport)  # default: an object written in the last RECENT_S stays
    assert report.deleted == [] and set(report.kept) == {"written recently"}
    assert report.collected_to == {f"{topic}:0": 0}  # so the next collection reads that record again
    assert collect_run(cfg, transport, recent_s=0).deleted != []


def test_retention_deletes_old_objects_a_reput_refreshes_and_a_dry_run_deletes_nothing(tmp_path, capsys):
    cfg = load_config(None, [f"model.path={tmp_path}", f"run.output_dir={tmp_path}", "run.name=collect",
                             "records.retention_hours=1"])
    store = claim_store(cfg)
    old, again, new = (store.put(bytes([i]) * 10_000) for i in range(3))
    hours_ago = time.time() - 2 * 3600
    for claim in (old, again):
        os.utime(Path(store.location) / claim.key, (hours_ago, hours_ago))
    store.put(bytes([1]) * 10_000)  # `again` written anew (a later record with the same part)
    config = tmp_path / "config.yaml"
    config.write_text(f"model: {{path: {tmp_path}}}\nrun: {{output_dir: {tmp_path}, name: collect}}\n"
                      "records: {retention_hours: 1}\n")
    assert records_main(["collect", str(config), "--dry-run"]) == 0
    assert "would delete 1 objects" in capsys.readouterr().out
    assert store.last_modified(old.sha256) is not None
    assert records_main(["collect", str(config), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["deleted"] == [old.sha256]
    assert [store.last_modified(c.sha256) is not None for c in (old, again, new)] == [False, True, True]


@pytest.fixture
def s3(tmp_path, monkeypatch):
    for k, v in S3_ENV.items():
        monkeypatch.setenv(k, v)
    server = ObjectServer(tmp_path / "s3")
    server.bucket("claims")
    yield server
    server.stop()


def s3_store(endpoint: str, **kw) -> ClaimStore:
    return ClaimStore("s3://claims/records", endpoint=endpoint, **kw)


def test_a_slow_store_is_retried_within_the_bound_then_dead_lettered(s3):
    upstream = ("127.0.0.1", int(s3.endpoint.rpartition(":")[2]))
    claim = s3_store(s3.endpoint).put(b"payload " * 10_000)
    with SlowProxy(upstream, lambda n: 3.0 if n < 2 else 0.0) as proxy:  # the first two attempts time out
        store = s3_store(f"http://{proxy.address}", fetch_retries=3, fetch_timeout_s=1.0)
        started = time.monotonic()
        assert store.get(claim) == b"payload " * 10_000
        assert store.retried == 2 and proxy.delayed == 2 and time.monotonic() - started < store.worst_case_s
    with SlowProxy(upstream, lambda n: float("inf")) as proxy:  # never answers
        store = s3_store(f"http://{proxy.address}", fetch_retries=2, fetch_timeout_s=0.5)
        started = time.monotonic()
        with pytest.raises(RecordError, match=f"claim {claim.sha256}: .* failed: .*after 3 attempts"):
            store.get(claim)
        assert proxy.connections == 3 and time.monotonic() - started < store.worst_case_s + 1
    # refuses every connection: the put is retried, then reported (the record is not sent)
    with SlowProxy(upstream, lambda n: 0.0, refuse=lambda n: True) as proxy:
        store = s3_store(f"http://{proxy.address}", fetch_retries=1, fetch_timeout_s=0.5)
        with pytest.raises(ClaimStoreError, match="after 2 attempts"):
            store.put(b"another payload " * 10_000)
        assert proxy.connections == 2


def test_a_missing_object_is_not_retried(s3):
    claim = s3_store(s3.endpoint).put(b"payload " * 10_000)
    upstream = ("127.0.0.1", int(s3.endpoint.rpartition(":")[2]))
    with SlowProxy(upstream, lambda n: 0.0) as proxy:
        store = s3_store(f"http://{proxy.address}", fetch_retries=3, fetch_timeout_s=2.0)
        store.delete(claim.sha256)
        with pytest.raises(RecordError, match="missing from the claim store"):
            store.get(claim)
        assert store.retried == 0
