"""Fleet-wide admission (rft/explorer/admission.py, fed by KafkaFleetFeed) against the real broker: capacity follows
(k + v_explorer + 1) * B - (v_trainer * B + backlog), the trainer's newest announcement wins whatever partition
it arrived on, live explorers share the capacity, and what an explorer admitted counts until the topic shows it. The
ledger on the broker: a fleet of three never takes more than the bound (the seeded schedules of
tests/unit/test_admission_ledger.py, here on real Kafka clients), and explorers claiming at once from their own
threads agree on every grant and never grant more than a claim's limit leaves."""
from __future__ import annotations

import threading
import time

import pytest

from rft.explorer.admission import AdmissionLedger, KafkaFleetFeed, StalenessAdmission
from rft.run.config import config_from_dict
from rft.schema import ControlMessage, decode, encode
from rft.transport import connect
from rft.transport.config import KafkaConfig
from rft.transport.control import AdmissionClaim, parse
from tests.records import make_group
from tests.unit.test_admission_ledger import Fleet
from tests.waiting import wait_until

pytestmark = pytest.mark.integration


def test_capacity_follows_versions_and_backlog(bootstrap, topic_prefix, tiny_model):
    cfg = config_from_dict({
        "run": {"name": topic_prefix, "mode": "off_policy", "max_staleness": 1, "groups_per_step": 4},
        "model": {"path": str(tiny_model)},
        "kafka": {"bootstrap_servers": bootstrap, "partitions": 2},
        "explorer": {"heartbeat_s": 5.0},
    })
    connect(cfg.kafka, bootstrap).admin().create_topics([cfg.topic("control")])
    connect(cfg.kafka, bootstrap).admin().create_topics([cfg.topic("experiences")], partitions=1)
    sink = connect(cfg.kafka, bootstrap).sink()
    experiences = cfg.topic("experiences")
    for i in range(10):
        sink.send_record(experiences, make_group(topic_prefix, i), key=f"g{i}")
    older, newer = time.time() - 10, time.time()
    # the newer announcement goes to partition 0, the older one to partition 1: partition order != time order
    for partition, (version, consumed, created) in ((0, (2, 8, newer)), (1, (1, 4, older))):
        message = ControlMessage(kind="weights", sender="trainer", created_at=created,
                                 body={"version": version, "offsets": {f"{experiences}:0": consumed}})
        value, headers = encode(message)
        sink.send(cfg.topic("control"), value, headers=headers, partition=partition)
    for other in ("explorer-a", "explorer-b"):
        sink.send_record(cfg.topic("control"), ControlMessage(kind="explorer_join", sender=other,
                                                              body={"explorer_id": other}))
    sink.flush()

    feed = KafkaFleetFeed(connect(cfg.kafka), control_topic=cfg.topic("control"), experiences_topic=experiences,
                          client_id="me-admission", live_horizon_s=3 * cfg.explorer.heartbeat_s,
                          explorer_id="explorer-b")  # this explorer is one of the two (rank 1 among a, b)
    admission = StalenessAdmission.for_mode("off_policy", max_staleness=1, groups_per_step=4, feed=feed, refresh_s=0.0)
    # (the version never goes back, so the explorer one version behind is checked first)
    admission.set_version(1)
    def version_read() -> bool:
        admission.admit(0)  # reads the feed
        return feed.view.trainer.version == 2

    wait_until(version_read, timeout=20, interval=0.2, what="the trainer's version 2 read from the control topic")
    assert feed.view.trainer.version == 2 and feed.view.trainer.offsets == {f"{experiences}:0": 8}
    assert admission.fleet_capacity() == (1 + 1 + 1) * 4 - (2 * 4 + 2)  # an explorer one version behind: fewer

    admission.set_version(2)
    assert feed.backlog() == 2  # 10 produced, 8 consumed
    assert admission.fleet_capacity() == (1 + 2 + 1) * 4 - (2 * 4 + 2)  # = 6
    assert admission.admit(10) == 3  # two live explorers share 6
    reading = feed.read()
    assert (reading.explorers, reading.rank) == (2, 1)
    alone = KafkaFleetFeed(connect(cfg.kafka), control_topic=cfg.topic("control"), experiences_topic=experiences,
                           client_id="new-admission", live_horizon_s=15, explorer_id="explorer-c")
    # the control topic's first records may take a poll or two
    reading = wait_until(lambda: (r := alone.read()) is not None and r.explorers >= 3 and r, timeout=20,
                         interval=0.2, what="a reading counting 3 explorers")
    assert (reading.explorers, reading.rank) == (3, 2)  # not heard from yet: counted, last
    alone.close()

    admission.refresh_s = 3600  # no new read of the topic's end: own admissions count meanwhile
    admission.fail(3)  # (the 3 admitted above were given up: their slots are free again)
    assert admission.admit(10) == 3 and admission.admit(10) == 0
    admission.close()
    sink.close()


def test_a_refused_explorer_wakes_on_the_trainers_announcement(bootstrap, topic_prefix, tiny_model):
    """`wait` returns within a fraction of a second of a control message (no polling interval on sync mode's
    critical path), and the next `admit` reads the new version at once."""
    cfg = config_from_dict({
        "run": {"name": topic_prefix, "mode": "sync", "groups_per_step": 2}, "model": {"path": str(tiny_model)},
        "kafka": {"bootstrap_servers": bootstrap, "partitions": 1},
    })
    admin = connect(cfg.kafka, bootstrap).admin()
    admin.create_topics([cfg.topic("control"), cfg.topic("experiences")], partitions=1)
    feed = KafkaFleetFeed(connect(cfg.kafka), control_topic=cfg.topic("control"),
                          experiences_topic=cfg.topic("experiences"), client_id="w-admission", live_horizon_s=15)
    admission = StalenessAdmission.for_mode("sync", max_staleness=0, groups_per_step=2, feed=feed, refresh_s=60.0)
    assert admission.admit(5) == 2 and admission.admit(5) == 0  # version 0's step is taken: refused
    started = time.monotonic()
    assert admission.wait(1.0) is False and 0.9 < time.monotonic() - started < 3.0  # nothing came: the timeout

    sink = connect(cfg.kafka, bootstrap).sink()

    def announce_later():
        time.sleep(1.0)  # not a wait for an event: the announcement must come while the explorer is waiting
        # Stamped before the send: the waiting explorer can wake (on the broker's copy) before `flush` returns here.
        announced.append(time.monotonic())
        sink.send_record(cfg.topic("control"), ControlMessage(kind="weights", sender="trainer", body={
            "version": 1, "offsets": {f"{cfg.topic('experiences')}:0": 2}}))
        sink.flush()

    announced: list[float] = []
    threading.Thread(target=announce_later, daemon=True).start()
    assert admission.wait(20.0) is True
    woke = time.monotonic()
    assert announced and woke - announced[0] < 0.5, woke - announced[0]  # not a polling interval later
    admission.finish(2)
    admission.set_version(1)
    assert admission.admit(5) == 2  # refresh_s is 60 s, yet the announcement is read at once


def test_a_fleet_of_three_never_takes_more_than_the_bound_on_the_broker(bootstrap, topic_prefix):
    fleet = Fleet(explorers=3, k=1, groups_per_step=4, seed=11, ledger=True,
                  transport=connect(KafkaConfig(), bootstrap), prefix=topic_prefix)
    try:
        # how far 100 actions get depends on how soon each feed reads the others' claims back from the broker:
        # the schedule goes on until the trainer has stepped 3 times (the bound must hold all along)
        actions = 0
        while fleet.trainer_version < 3 and actions < 1000:
            fleet.run(50)
            actions += 50
    finally:
        fleet.close()
    assert fleet.trainer_version >= 3, f"the schedule must make progress ({actions} actions)"
    assert fleet.worst_excess <= 0, fleet.worst_excess


def test_explorers_claiming_at_once_agree_on_every_grant(bootstrap, topic_prefix):
    """Three feeds (each its own clients) claim from three threads at once; afterwards each feed's ledger and an
    independent fold of the whole log give the same grants, and no claim got more than its limit left."""
    control, experiences = f"{topic_prefix}.control", f"{topic_prefix}.experiences"
    admin = connect(KafkaConfig(), bootstrap).admin()
    admin.create_topics([control], partitions=2)
    admin.create_topics([experiences], partitions=1)
    admin.close()
    sink = connect(KafkaConfig(), bootstrap).sink()
    for i in range(3):  # live explorers: nobody reclaims another's groups
        sink.send_record(control, ControlMessage(kind="explorer_join", sender=f"x{i}", body={"explorer_id": f"x{i}"}))
    sink.flush()
    sink.close()
    feeds = [KafkaFleetFeed(connect(KafkaConfig(), bootstrap), control_topic=control, experiences_topic=experiences,
                            client_id=f"x{i}", live_horizon_s=600, explorer_id=f"x{i}") for i in range(3)]
    granted: dict[str, list[int]] = {f.explorer_id: [] for f in feeds}

    def claimer(feed: KafkaFleetFeed) -> None:
        for i in range(12):
            reading = feed.read()
            got = feed.claim(3, limit=10, seen=reading.seen, version=0)
            granted[feed.explorer_id].append(got)
            if got and i % 2:
                feed.release(got)

    threads = [threading.Thread(target=claimer, args=(f,)) for f in feeds]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads)
    source = connect(KafkaConfig(), bootstrap).source()
    log = [m for m in source.read_range(control, idle_timeout_s=2) if m.partition == 0]
    source.close()
    fold, grants = AdmissionLedger(), {}
    for m in log:
        kind = parse(decode(m.value, m.headers))
        got = fold.apply(m.offset, kind)
        if isinstance(kind, AdmissionClaim):
            grants.setdefault(kind.explorer_id, []).append(got)
            assert got <= max(0, kind.limit - fold.outstanding_at(kind.seen) + got)
    assert grants == granted  # each explorer's grants, as it learned them, are the log's
    for feed in feeds:
        feed.read()
        wait_until(lambda f=feed: f.ledger.position >= log[-1].offset + 1 or (f.read() and False), timeout=20,
                   interval=0.1, what="every feed folding the whole log")
        assert (feed.ledger.granted, feed.ledger.released, feed.ledger.outstanding) == (
            fold.granted, fold.released, fold.outstanding)
    for feed in feeds:  # (closing releases a feed's groups: after every feed was checked)
        feed.close()
    assert 0 < fold.granted - fold.released <= 10


def test_async_explorers_wait_at_the_flow_control_bound(bootstrap, topic_prefix, tiny_model):
    """async mode through `build_admission` (what an explorer of `rft run` builds) on the real broker: with
    run.async_max_staleness L the fleet may start (L + 0 + 1) * B groups at version 0, then waits for the trainer,
    fed by the control topic as off_policy's admission is; with null it never waits."""
    from rft.explorer.main import build_admission

    def config(lead):
        return config_from_dict({
            "run": {"name": topic_prefix, "mode": "async", "async_max_staleness": lead, "groups_per_step": 2},
            "model": {"path": str(tiny_model)}, "kafka": {"bootstrap_servers": bootstrap, "partitions": 1},
        })
    cfg = config(1)
    connect(cfg.kafka, bootstrap).admin().create_topics([cfg.topic("control"), cfg.topic("experiences")],
                                                          partitions=1)
    admission = build_admission(cfg, "explorer-a")
    try:
        assert isinstance(admission.feed, KafkaFleetFeed) and admission.max_staleness == 1
        assert admission.admit(100) == 4 and admission.admit(100) == 0  # (1 + 0 + 1) * 2, then it waits
    finally:
        admission.feed.close()
    unbounded = build_admission(config(None), "explorer-b")
    assert unbounded.feed is None and unbounded.admit(100) == 100
