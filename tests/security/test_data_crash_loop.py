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

import time

import numpy as np
import pytest

from rft.models.moe import MoEShape
from rft.schema import (
    HEADER_ERROR,
    MAX_COMPONENTS,
    MAX_ID_CHARS,
    Feedback,
    RewardRange,
    RoutedExperts,
    ServedChoice,
    ServedCompletion,
)
from rft.serve.config import ServeConfig
from rft.serve.joiner import Joiner
from rft.trainer import feed as feed_module
from rft.trainer.batch import TrainableLimits
from rft.trainer.feed import FeedState, open_feed
from rft.transport import connect
from rft.transport.config import KafkaConfig
from rft.transport.run_topics import RunTopics
from tests.records import make_group, send_groups
from tests.waiting import wait_until

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


def served_record(rid: str, *, prompt_len: int = 3, n: int = 2) -> ServedCompletion:
    choices = [ServedChoice(i, np.array([5 + i, 6], np.int32), np.array([-0.5, -0.25], np.float32), "stop")
               for i in range(n)]
    return ServedCompletion(run_id=RUN, request_id=rid, prompt_key=rid, choices=choices, policy_version=0,
                            prompt_tokens=np.arange(prompt_len, dtype=np.int32) % 100 + 1)


def step_until(joiner: Joiner, n_groups: int) -> list:
    groups: list = []
    wait_until(lambda: groups.extend(joiner.step()) or len(groups) >= n_groups, timeout=20, interval=0,
               what=f"{n_groups} joined groups")
    return groups


RUN = "serve-crash"


def test_the_joiner_refuses_poisoned_feedback_and_oversized_groups_and_a_restarted_joiner_goes_on(
        bootstrap, topic_prefix):
    topics = RunTopics(run=RUN, tasks=f"{topic_prefix}.tasks", experiences=f"{topic_prefix}.experiences",
                       control=f"{topic_prefix}.control", dead_letter=f"{topic_prefix}.dead_letter",
                       explorers_group=f"{topic_prefix}.explorers", served=f"{topic_prefix}.served",
                       feedback=f"{topic_prefix}.feedback")
    producer = connect(KafkaConfig(partitions=1), bootstrap).sink(linger_ms=0)
    kafka = KafkaConfig(partitions=1, max_record_bytes=20_000)  # the joiner's limit: a 2 x 4000-token group is over
    settings = ServeConfig(group_size=2, group_wait_s=1.0, feedback_expire_s=600.0)
    joiner = Joiner(settings, topics=topics, kafka=kafka, transport=connect(kafka, bootstrap), client_id="joiner-1")
    now = time.time()
    poisoned = [Feedback(run_id=RUN, request_id="ok", reward=1.0, index=0, created_at=float("nan")),
                Feedback(run_id=RUN, request_id="ok", reward=1.0, index=0, created_at=now + 10**9),
                Feedback(run_id=RUN, request_id="ok", reward=1.0, index=0,
                         components={f"c{i}": 1.0 for i in range(MAX_COMPONENTS + 1)}),
                Feedback(run_id=RUN, request_id="x" * (MAX_ID_CHARS + 1), reward=1.0, index=0)]
    records = [(topics.served, served_record("big", prompt_len=4000)), (topics.served, served_record("ok")),
               *[(topics.feedback, Feedback(run_id=RUN, request_id="big", reward=float(i), index=i)) for i in (0, 1)],
               *[(topics.feedback, f) for f in poisoned],
               *[(topics.feedback, Feedback(run_id=RUN, request_id="ok", reward=float(i), index=i)) for i in (0, 1)]]
    for topic, record in records:
        producer.send_record(topic, record, key=record.request_id[:64])
    producer.flush()
    try:
        [group] = step_until(joiner, 1)
        assert group.group_id == f"{RUN}/serve/ok" and [s.reward for s in group.samples] == [0.0, 1.0]
        assert joiner.joining.counts["groups_too_large"] == 1  # refused and counted: the joiner did not die
        ends = {**joiner.source.end_offsets(topics.served), **joiner.source.end_offsets(topics.feedback)}
        wait_until(lambda: joiner.step() is not None and joiner.source.committed(topics.feedback)
                   == joiner.source.end_offsets(topics.feedback), timeout=10, interval=0,
                   what="the joiner's commits past every record (nothing held: no NaN time holds them)")
        assert {**joiner.source.committed(topics.served), **joiner.source.committed(topics.feedback)} == ends
    finally:
        joiner.close()
    reasons = dead_reasons(connect(kafka, bootstrap), topics.dead_letter)
    assert len(reasons) == 4, reasons
    assert sum("'created_at'" in r and "is not a time" in r for r in reasons) == 2
    assert any(f"components: {MAX_COMPONENTS + 1} components" in r for r in reasons)
    assert any(f"field 'request_id': {MAX_ID_CHARS + 1} characters" in r for r in reasons)

    # a restarted joiner (same consumer group) reads nothing of it again and joins what comes next
    restarted = Joiner(settings, topics=topics, kafka=kafka, transport=connect(kafka, bootstrap), client_id="joiner-2")
    try:
        producer.send_record(topics.served, served_record("next"))
        for i in (0, 1):
            producer.send_record(topics.feedback, Feedback(run_id=RUN, request_id="next", reward=float(i), index=i))
        producer.flush()
        [group] = step_until(restarted, 1)
        assert group.group_id == f"{RUN}/serve/next"
        assert restarted.joining.counts["served"] == 1 and restarted.joining.counts["groups_too_large"] == 0
    finally:
        restarted.close()
        producer.close()


def test_the_feed_keeps_a_bounded_number_of_short_group_ids_and_a_resumed_feed_goes_on(bootstrap, topic_prefix,
                                                                                        monkeypatch):
    monkeypatch.setattr(feed_module, "MAX_TAKEN_IDS", 3)
    cfg = KafkaConfig(partitions=1)
    transport = connect(cfg, bootstrap)
    topic, dlq = f"{topic_prefix}.experiences", f"{topic_prefix}.dead_letter"
    transport.admin().create_topics([topic, dlq])
    good = [make_group("run", i) for i in range(7)]
    long_id = make_group("run", 99)
    long_id.group_id = "run/" + "x" * MAX_ID_CHARS  # kept forever before: any length, any number
    sink = transport.sink()
    send_groups(sink, topic, [good[0], long_id, *good[1:5]])
    sink.flush()

    def consume(state: FeedState | None, n: int):
        feed, dlq_sink, source = open_feed(transport, topic=topic, dead_letter_topic=dlq, run_id="run", state=state)
        try:
            batch = feed.next_batch(n, timeout_s=10)
            assert len(feed.state.taken_groups) == 3  # also in memory, between checkpoints
            return [g.group_id for g in batch.groups], dict(batch.skipped), feed.snapshot()
        finally:
            dlq_sink.flush()
            dlq_sink.close()
            source.close()

    taken, skipped, state = consume(None, 5)
    assert taken == [g.group_id for g in good[:5]] and skipped == {"dead_letter": 1}
    assert state.taken_groups == [g.group_id for g in good[2:5]]  # the last 3 only
    send_groups(sink, topic, [good[4], good[5], good[3], good[6]])  # two redeliveries the resume still knows
    sink.flush()
    sink.close()
    taken, skipped, state = consume(FeedState.from_json(state.to_json()), 2)
    assert taken == [good[5].group_id, good[6].group_id] and skipped == {"duplicate": 2}
    assert state.taken_groups == [g.group_id for g in good[4:7]]
    [reason] = dead_reasons(transport, dlq)
    assert f"field 'group_id': {MAX_ID_CHARS + 4} characters, over {MAX_ID_CHARS}" in reason
