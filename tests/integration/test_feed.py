"""The trainer's experience feed against the real broker: whole groups, duplicates and garbage skipped and
counted, and a feed restarted from a saved FeedState continues exactly where the saved one stopped."""
from __future__ import annotations

import pytest

from rft.trainer.feed import FeedState, FeedTimeout, open_feed
from rft.transport import connect
from rft.transport.config import KafkaConfig
from tests.records import make_group, send_groups

pytestmark = pytest.mark.integration


def fill_topic(bootstrap, cfg, topic, items):
    sink = connect(cfg, bootstrap).sink()
    send_groups(sink, topic, items)
    sink.flush()
    sink.close()


def consume_steps(bootstrap, cfg, topic, dlq, steps, state=None, per_step=3):
    feed, sink, source = open_feed(connect(cfg, bootstrap), topic=topic, dead_letter_topic=dlq, run_id="run",
                                   state=state)
    trained, skipped = [], {}
    try:
        for step in steps:
            batch = feed.next_batch(per_step, timeout_s=5)
            trained += [(g.group_id, step) for g in batch.groups]
            for k, v in batch.skipped.items():
                skipped[k] = skipped.get(k, 0) + v
        return trained, skipped, feed.snapshot()
    finally:
        sink.flush()
        sink.close()
        source.close()


def test_feed_exactly_once_across_restart(bootstrap, topic_prefix):
    cfg = KafkaConfig(partitions=1)
    topic, dlq = f"{topic_prefix}.experiences", f"{topic_prefix}.dead_letter"
    connect(cfg, bootstrap).admin().create_topics([topic, dlq])
    groups = [make_group("run", i) for i in range(12)]
    items = groups[:4] + [b"\x93garbage", groups[1]] + groups[4:9] + [make_group("other-run", 99)] + groups[9:]
    fill_topic(bootstrap, cfg, topic, items)

    whole, skipped, _ = consume_steps(bootstrap, cfg, topic, dlq, steps=[1, 2, 3, 4])
    assert [g for g, _ in whole] == [g.group_id for g in groups]
    assert skipped == {"dead_letter": 1, "duplicate": 1, "foreign": 1}

    first, _, state = consume_steps(bootstrap, cfg, topic, dlq, steps=[1, 2])
    saved = FeedState.from_json(state.to_json())  # what a checkpoint stores (JSON)
    rest, _, _ = consume_steps(bootstrap, cfg, topic, dlq, steps=[3, 4], state=saved)
    assert first + rest == whole

    with pytest.raises(FeedTimeout):
        consume_steps(bootstrap, cfg, topic, dlq, steps=[5], state=FeedState.from_json(_final_state(
            bootstrap, cfg, topic, dlq).to_json()))

    source = connect(cfg, bootstrap).source()
    dead = list(source.read_range(dlq))
    source.close()
    reasons = sorted(dict(m.headers)["rft-error"].decode() for m in dead)
    assert len(dead) >= 2 and any("not msgpack" in r for r in reasons) and any("foreign" in r for r in reasons)


def _final_state(bootstrap, cfg, topic, dlq):
    return consume_steps(bootstrap, cfg, topic, dlq, steps=[1, 2, 3, 4])[2]
