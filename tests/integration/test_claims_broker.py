"""The claim-check on the real broker: groups too large for a 1 MB record are produced through a sink with a claim
store (a directory), every record on the topic stays under the limit, and the trainer's feed takes them resolved
(inline, decodable with no store); a group whose object was deleted is dead-lettered with the reason, the feed goes
on, and a feed restarted from its state does not read it again; a replay window (`rft replay`'s path) reads them
back. A group whose samples show one 300 KB image sends it claim-checked, stored once, and reads back equal."""
from __future__ import annotations

import os

import pytest

from rft.schema import TaskRecord, decode_group, decode_task
from rft.trainer.feed import EndOfReplay, FeedState, open_feed, resolve_window
from rft.transport import ClaimStore, claims_in, connect, record_size
from rft.transport.base import resolve_claims
from rft.transport.claims import HEADER_CLAIMS
from rft.transport.config import KafkaConfig
from tests.records import make_group, make_image

pytestmark = pytest.mark.integration

LIMIT = 1_000_000


def test_claimed_groups_through_the_feed_the_dead_letters_and_a_replay(bootstrap, topic_prefix, tmp_path):
    cfg = KafkaConfig(partitions=1, max_record_bytes=LIMIT)
    store = ClaimStore(tmp_path / "records", threshold=131072)
    transport = connect(cfg, bootstrap, claims=store)
    topic, dlq = f"{topic_prefix}.experiences", f"{topic_prefix}.dead_letter"
    admin = transport.admin()
    admin.create_topics([topic, dlq])
    admin.close()
    groups = [make_group("run", 0),  # small: sent inline
              make_group("run", 1, n_samples=8, response_len=40_000),  # 2.9 MB: its token arrays claimed
              make_group("run", 2, n_samples=8, response_len=40_000),  # its object is deleted below
              make_group("run", 3, n_samples=2500, response_len=60),  # 1.3 MB of small parts: claimed whole
              make_group("run", 4, n_samples=8, response_len=40_000)]
    sink = transport.sink()
    for g in groups:
        sink.send_record(topic, g, key=g.group_id)
    sink.flush()

    source = connect(cfg, bootstrap).source()  # no claim store: the records as they are on the topic
    sent = list(source.read_range(topic))
    source.close()
    assert len(sent) == 5 and all(record_size(m.value, m.key, m.headers) <= LIMIT for m in sent)
    counts = [dict(m.headers).get(HEADER_CLAIMS) for m in sent]
    assert counts[0] is None and counts[3] == b"1" and all(int(counts[i] or 0) > 1 for i in (1, 2, 4))
    lost = claims_in(sent[2].value)[0]
    os.remove(os.path.join(store.location, lost.key))

    feed, dlq_sink, feed_source = open_feed(transport, topic=topic, dead_letter_topic=dlq, run_id="run")
    try:
        batch = feed.next_batch(4, timeout_s=30)
        state = FeedState.from_json(feed.snapshot().to_json())
    finally:
        dlq_sink.flush()
        dlq_sink.close()
        feed_source.close()
    kept = [groups[i] for i in (0, 1, 3, 4)]
    assert batch.groups == kept and dict(batch.skipped) == {"dead_letter": 1}
    # what rank 0 broadcasts: inline values that decode on a rank without a store
    assert [decode_group(m.value) for m in batch.messages] == kept
    assert all(HEADER_CLAIMS not in dict(m.headers) for m in batch.messages)

    source = connect(cfg, bootstrap).source()
    [dead] = list(source.read_range(dlq))
    source.close()
    reason = dict(dead.headers)["rft-error"].decode()
    assert f"claim {lost.sha256}" in reason and "missing from the claim store" in reason
    assert dead.value == sent[2].value and dict(dead.headers)["rft-origin"] == f"{topic}:0@2".encode()

    late = make_group("run", 5, n_samples=8, response_len=40_000)
    sink.send_record(topic, late, key=late.group_id)
    sink.flush()
    sink.close()
    feed, dlq_sink, feed_source = open_feed(transport, topic=topic, dead_letter_topic=dlq, run_id="run", state=state)
    try:
        batch = feed.next_batch(1, timeout_s=30)  # the restarted feed starts after the dead letter
    finally:
        dlq_sink.close()
        feed_source.close()
    assert batch.groups == [late] and dict(batch.skipped) == {}

    source = transport.source()
    window = resolve_window(source, topic)
    source.close()
    replay, dlq_sink, replay_source = open_feed(transport, topic=topic, dead_letter_topic=dlq, run_id=None,
                                                window=window)
    try:
        with pytest.raises(EndOfReplay) as end:
            replay.next_batch(100, timeout_s=30)
    finally:
        dlq_sink.close()
        replay_source.close()
    assert end.value.batch.groups == [*kept, late] and dict(end.value.batch.skipped) == {"dead_letter": 1}


def test_a_groups_images_travel_claim_checked_and_stored_once(bootstrap, topic_prefix, tmp_path):
    """Eight samples that show the same 300 KB PNG (and its task): the image is one object in the store, every record
    on the topic is small, and the group and the task read back equal through a real broker."""
    cfg = KafkaConfig(partitions=1, max_record_bytes=LIMIT)
    store = ClaimStore(tmp_path / "records", threshold=131072)
    transport = connect(cfg, bootstrap, claims=store)
    topic = f"{topic_prefix}.experiences"
    admin = transport.admin()
    admin.create_topics([topic])
    admin.close()
    image, small = make_image(320, 320, noise=True), make_image(16, 16, fmt="JPEG")
    assert 290_000 < len(image.data) < 320_000
    group = make_group("run", 0, n_samples=8)
    for s in group.samples:
        s.images, s.prompt_text = [image, small], "<image><image>which is larger?"
    task = TaskRecord("run", "t0", 0, "what is in the picture?", answer="noise", images=[image])
    sink = transport.sink()
    sink.send_record(topic, group, key=group.group_id)
    sink.send_record(topic, task, key=task.task_id)
    sink.flush()
    sink.close()

    source = transport.source()
    sent = list(source.read_range(topic))
    source.close()
    assert [record_size(m.value, m.key, m.headers) < 20_000 for m in sent] == [True, True]
    assert {c.sha256 for m in sent for c in claims_in(m.value)} == {image.sha256}  # the small image stays inline
    assert [len(claims_in(m.value)) for m in sent] == [8, 1]
    assert len([p for p in (tmp_path / "records").rglob("*") if p.is_file()]) == 1  # stored once
    first, second = (resolve_claims(m, store) for m in sent)
    assert decode_group(first.value, first.headers) == group
    assert decode_task(second.value, second.headers) == task
