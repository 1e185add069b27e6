"""Staleness policies (`trainer.staleness_policy`) in the trainer's feed, against the real broker: on one topic with
mixed policy versions (stragglers), each policy's order, its evictions counted, the mode's bound held (off_policy,
max_staleness 2), and every group taken at most once when the feed restarts from its checkpointed state (the held
pool re-read by offset) with the batches an uninterrupted feed assembles."""
from __future__ import annotations

import pytest

from rft.experience.staleness_policies import build_staleness_policy
from rft.trainer.feed import FeedState, open_feed
from rft.trainer.staleness import StalenessTracker
from rft.transport import connect
from rft.transport.config import KafkaConfig
from tests.records import make_group, send_groups

pytestmark = pytest.mark.integration

BOUND = 2  # off_policy, run.max_staleness 2: staleness (step - 1) - version in [0, 2]
# the log: name -> policy version. G0, K0 and O1 are stragglers; read from a full log, no policy reads a version
# newer than its step's weights (what explorers cannot produce yet)
LOG = [("A", 0), ("B", 0), ("C", 0), ("D", 0), ("E", 1), ("F", 1), ("G", 0), ("H", 1),
       ("I", 2), ("J", 2), ("K", 0), ("L", 2), ("M", 3), ("N", 3), ("O", 1), ("P", 3)]
TASK = {name: i for i, (name, _) in enumerate(LOG)}
NAME = {}


@pytest.fixture
def mixed_topic(bootstrap, topic_prefix):
    cfg = KafkaConfig(partitions=1)
    topic, dlq = f"{topic_prefix}.experiences", f"{topic_prefix}.dead_letter"
    connect(cfg, bootstrap).admin().create_topics([topic, dlq])
    groups = [make_group("run", TASK[name], policy_version=version) for name, version in LOG]
    NAME.update({g.group_id: name for g, (name, _) in zip(groups, LOG, strict=True)})
    sink = connect(cfg, bootstrap).sink()
    send_groups(sink, topic, groups)
    sink.flush()
    sink.close()
    return cfg, topic, dlq


def run_steps(bootstrap, topic_setup, policy, pool, steps, state=None, window=1):
    """Steps of 2 groups: [(step, [names])], skip counts, the state after them."""
    cfg, topic, dlq = topic_setup
    tracker = StalenessTracker(mode="off_policy", max_staleness=BOUND)
    feed, sink, source = open_feed(connect(cfg, bootstrap), topic=topic, dead_letter_topic=dlq, run_id="run",
                                   state=state, policy=build_staleness_policy(policy, window=window), pool=pool)
    taken, skipped = [], {}
    try:
        for step in steps:
            batch = feed.next_batch(2, admit=lambda g, s=step: tracker.check(g, s), version=step - 1, timeout_s=10)
            taken.append((step, [NAME[g.group_id] for g in batch.groups]))
            for g in batch.groups:  # the bound, whatever the policy
                assert 0 <= (step - 1) - g.policy_version <= BOUND, (policy, step, NAME[g.group_id])
            for k, v in batch.skipped.items():
                skipped[k] = skipped.get(k, 0) + v
        return taken, skipped, feed.snapshot()
    finally:
        sink.close()
        source.close()


def test_each_policy_orders_evicts_and_keeps_the_bound(bootstrap, mixed_topic):
    steps = [1, 2, 3, 4]
    in_order, skipped, state = run_steps(bootstrap, mixed_topic, "in_order", 0, steps)
    assert in_order == [(1, ["A", "B"]), (2, ["C", "D"]), (3, ["E", "F"]), (4, ["H", "I"])]
    assert skipped == {"stale": 1} and state.held == []  # G0 at step 4: staleness 3

    oldest, skipped, state = run_steps(bootstrap, mixed_topic, "oldest_version_first", 4, steps)
    # step 3 picks the straggler G0 before E1; step 4 the held F1, H1 before the fresher I2, J2 it read
    assert oldest == [(1, ["A", "B"]), (2, ["C", "D"]), (3, ["G", "E"]), (4, ["F", "H"])]
    assert skipped == {} and [NAME[h["group_id"]] for h in state.held] == ["I", "J"]

    windowed, skipped, state = run_steps(bootstrap, mixed_topic, "windowed", 4, steps)
    # window [v - 1, v]: G0 is evicted on arrival at step 3, the held H1 at step 4; K0 is past the mode's bound
    assert windowed == [(1, ["A", "B"]), (2, ["C", "D"]), (3, ["E", "F"]), (4, ["I", "J"])]
    assert skipped == {"evicted": 2, "stale": 1} and [NAME[h["group_id"]] for h in state.held] == ["L", "M"]


@pytest.mark.parametrize("policy", ["oldest_version_first", "windowed"])
def test_exactly_once_across_a_restart_from_the_checkpointed_pool(bootstrap, mixed_topic, policy):
    whole, whole_skipped, _ = run_steps(bootstrap, mixed_topic, policy, 4, [1, 2, 3, 4])
    first, first_skipped, state = run_steps(bootstrap, mixed_topic, policy, 4, [1, 2])
    assert state.held  # the restart must re-read held groups
    saved = FeedState.from_json(state.to_json())  # what a checkpoint stores (JSON)
    rest, rest_skipped, _ = run_steps(bootstrap, mixed_topic, policy, 4, [3, 4], state=saved)
    assert first + rest == whole
    names = [n for _, batch in whole for n in batch]
    assert len(names) == len(set(names))
    assert {k: first_skipped.get(k, 0) + rest_skipped.get(k, 0) for k in whole_skipped} == whole_skipped
