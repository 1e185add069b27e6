"""Experience operators in the trainer's feed, against the real broker: groups written to a topic are read back
through `open_feed` with a chain of every built-in; drops are skipped and counted by reason, shaped rewards equal a
plain computation (also in the re-encoded messages the other ranks decode), and a feed restarted from its saved
state (JSON, as in a checkpoint) makes exactly the decisions of an uninterrupted one, dedup's memory included."""
from __future__ import annotations

import re

import numpy as np
import pytest

from rft.experience.operators import OperatorContext, build_operator_chain
from rft.schema import decode_group
from rft.trainer.feed import FeedState, open_feed
from rft.transport import connect
from rft.transport.config import KafkaConfig
from tests.integration.test_feed import fill_topic
from tests.records import make_group

pytestmark = pytest.mark.integration

PATTERN = r"<ok>"
SPECS = ["dedup", "zero_variance", {"name": "response_length", "max_tokens": 30},
         {"name": "repetition", "n": 3, "max_ratio": 0.6},
         {"name": "length_penalty", "start": 8, "end": 16, "penalty": 0.5},
         {"name": "format_bonus", "pattern": PATTERN, "bonus": 0.2}]


def scenario(encode_text):
    """(the groups in topic order, the reason each is dropped or None)."""
    text = [encode_text(t) for t in ("abc <ok>", "abcdefghijkl", "hello world <ok> again", "no")]
    loop = encode_text("ab" * 10)

    def g(task, rewards, responses, **kw):
        return make_group("run", task, rewards=rewards, responses=responses, **kw)

    items = [
        (g(0, [0.0, 1.0, 1.0, 0.0], text), None),
        (g(1, [1.0, 1.0, 1.0, 1.0], text), "dropped/zero_variance"),
        (g(2, [0.0, 1.0], [text[0], encode_text("y" * 40)]), "dropped/response_length"),
        (g(3, [0.0, 1.0], [loop, text[2]]), "dropped/repetition"),
        (g(4, [1.0, 0.0, 0.5, 0.5], text), None),
        (g(1, [0.0, 1.0, 1.0, 1.0], text, seed=9), "dropped/dedup"),  # re-delivery of a dropped group, now with signal
        (g(5, [0.2, 0.9], text[:2]), None),
        (g(0, [1.0, 0.0, 0.0, 0.0], text, seed=7), "duplicate"),  # the feed's own check: already taken
        (g(6, [0.0, 0.0], text[2:]), "dropped/zero_variance"),
        (g(7, [0.1, 0.6, 0.3, 0.0], text), None),
        (g(8, [1.0, 0.0], text[1:3]), None),
        (g(9, [0.5, 0.0], text[:2]), None),
    ]
    return [group for group, _ in items], [reason for _, reason in items]


def expected_reward(sample, text: str) -> float:
    n = len(sample.response_tokens)
    return sample.reward - 0.5 * min(1.0, max(0.0, (n - 8) / 8)) + (0.2 if re.search(PATTERN, text) else 0.0)


def consume(bootstrap, cfg, topic, dlq, context, steps, state=None):
    chain = build_operator_chain(SPECS, context)
    feed, sink, source = open_feed(connect(cfg, bootstrap), topic=topic, dead_letter_topic=dlq, run_id="run",
                                   state=state, operators=chain)
    out = []
    try:
        for _ in range(steps):
            batch = feed.next_batch(2, timeout_s=10)
            out.append((batch.groups, [decode_group(m.value, m.headers) for m in batch.messages], dict(batch.skipped)))
        return out, FeedState.from_json(feed.snapshot().to_json())
    finally:
        sink.close()
        source.close()


def test_operator_chain_in_the_feed_survives_a_restart(bootstrap, topic_prefix, tiny_model):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model))
    context = OperatorContext(str(tiny_model))
    cfg = KafkaConfig(partitions=1)
    topic, dlq = f"{topic_prefix}.experiences", f"{topic_prefix}.dead_letter"
    connect(cfg, bootstrap).admin().create_topics([topic, dlq])
    groups, reasons = scenario(lambda t: tokenizer.encode(t, add_special_tokens=False))
    fill_topic(bootstrap, cfg, topic, groups)

    whole, _ = consume(bootstrap, cfg, topic, dlq, context, steps=3)
    taken = [g.group_id for step in whole for g in step[0]]
    assert taken == [g.group_id for g, r in zip(groups, reasons, strict=True) if r is None]
    skipped = {}
    for _, _, counts in whole:
        for k, v in counts.items():
            skipped[k] = skipped.get(k, 0) + v
    expected = {}
    for r in reasons:
        if r:
            expected[r] = expected.get(r, 0) + 1
    assert skipped == expected

    originals = {g.group_id: g for g, r in zip(groups, reasons, strict=True) if r is None}
    for step_groups, rank_view, _ in whole:
        assert rank_view == step_groups  # what the other ranks decode is the shaped group
        for shaped in step_groups:
            original = originals[shaped.group_id]
            texts = [tokenizer.decode(s.response_tokens, skip_special_tokens=True) for s in original.samples]
            expected_rewards = [expected_reward(s, t) for s, t in zip(original.samples, texts, strict=True)]
            np.testing.assert_allclose(shaped.rewards, expected_rewards, rtol=0, atol=1e-12)

    first, state = consume(bootstrap, cfg, topic, dlq, context, steps=1)
    assert "0:dedup" in state.operators and groups[1].group_id in state.operators["0:dedup"]["seen"]
    rest, _ = consume(bootstrap, cfg, topic, dlq, context, steps=2, state=state)
    resumed = first + rest
    assert [[g.group_id for g in s[0]] for s in resumed] == [[g.group_id for g in s[0]] for s in whole]
    assert [[g.rewards.tolist() for g in s[0]] for s in resumed] == [[g.rewards.tolist() for g in s[0]] for s in whole]
    assert [s[2] for s in resumed] == [s[2] for s in whole]
