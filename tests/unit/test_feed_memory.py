"""The trainer's ExperienceFeed (rft/trainer/feed.py) over the in-memory transport, no broker: whole groups in
log order, exactly once across a restart from saved positions, duplicates skipped by group id (also across the
restart), dead letters and foreign records diverted with the reason, a failed source replaced at the feed's own
positions, a replay window that ends, and dynamic sampling (groups without reward variance dropped and refilled)."""
from __future__ import annotations

import pytest

from rft.schema import HEADER_ERROR
from rft.trainer.feed import EndOfReplay, FeedState, FeedTimeout, ReplayWindow, open_feed
from rft.transport import HEADER_ORIGIN, TransportError
from rft.transport.base import HEADER_OMITTED
from rft.transport.memory import MemoryTransport
from tests.records import make_group, send_groups

TOPIC, DLQ = "run.experiences", "run.dead_letter"
GARBAGE = b"\x93garbage"


def broker(partitions: int = 1) -> MemoryTransport:
    transport = MemoryTransport(partitions=partitions)
    transport.admin().create_topics([TOPIC, DLQ])
    return transport


def fill(transport: MemoryTransport, items) -> None:
    send_groups(transport.sink(), TOPIC, items)


def consume(transport, steps: int, state: FeedState | None = None, per_step: int = 3, **feed_args):
    """Group ids taken per step, skip counts, and the saved state (as a checkpoint stores it: JSON)."""
    feed, sink, source = open_feed(transport, topic=TOPIC, dead_letter_topic=DLQ, run_id="run", state=state,
                                   **feed_args)
    taken, skipped = [], {}
    try:
        for _ in range(steps):
            batch = feed.next_batch(per_step, timeout_s=0.5)
            assert [m.key.decode() for m in batch.messages] == [g.group_id for g in batch.groups]
            taken.append([g.group_id for g in batch.groups])
            for k, v in batch.skipped.items():
                skipped[k] = skipped.get(k, 0) + v
        return taken, skipped, FeedState.from_json(feed.snapshot().to_json())
    finally:
        sink.close()
        source.close()


GROUPS = [make_group("run", i) for i in range(12)]
ITEMS = GROUPS[:4] + [GARBAGE, GROUPS[1]] + GROUPS[4:9] + [make_group("other-run", 99)] + GROUPS[9:]


def fill_and_return(transport: MemoryTransport) -> MemoryTransport:
    fill(transport, ITEMS)
    return transport


def test_whole_groups_in_log_order_with_skips_counted():
    taken, skipped, state = consume(fill_and_return(broker()), steps=4)
    assert sum(taken, []) == [g.group_id for g in GROUPS]
    assert skipped == {"dead_letter": 1, "duplicate": 1, "foreign": 1}
    assert state.offsets == {f"{TOPIC}:0": len(ITEMS)} and state.taken_groups == [g.group_id for g in GROUPS]


def test_exactly_once_across_a_restart_from_saved_positions():
    transport = fill_and_return(broker())
    whole, _, _ = consume(transport, steps=4)
    first, _, saved = consume(transport, steps=2)
    rest, _, _ = consume(transport, steps=2, state=saved)
    assert first + rest == whole


def test_duplicates_are_skipped_by_group_id_across_a_restart():
    transport = broker()
    fill(transport, GROUPS[:3])
    first, _, saved = consume(transport, steps=1)
    fill(transport, [GROUPS[0], GROUPS[2]] + GROUPS[3:6])  # an explorer delivered 0 and 2 again (at-least-once)
    rest, skipped, _ = consume(transport, steps=1, state=saved)
    assert first + rest == [[g.group_id for g in GROUPS[:3]], [g.group_id for g in GROUPS[3:6]]]
    assert skipped == {"duplicate": 2}


def test_dead_letters_are_diverted_with_the_reason():
    transport = fill_and_return(broker())
    consume(transport, steps=4)
    dead = list(transport.source().read_range(DLQ))
    reasons = [dict(m.headers)[HEADER_ERROR].decode() for m in dead]
    assert len(dead) == 2 and "not msgpack" in reasons[0] and reasons[1].startswith("foreign record: run 'other-run'")
    assert dead[0].value == GARBAGE and dict(dead[0].headers)[HEADER_ORIGIN] == f"{TOPIC}:0@4".encode()


def test_a_record_over_the_limit_is_dead_lettered_without_its_value():
    """A foreign producer's record larger than rft's sinks may send (up to what the broker took): the dead letter
    names it and its size, its value stays on its origin, and the feed goes on (kafka-python would refuse to send
    the copy, and the trainer would meet the record again at every restart)."""
    transport = MemoryTransport(partitions=1, max_record_bytes=50_000)
    transport.admin().create_topics([TOPIC, DLQ])
    transport.sink().send(TOPIC, b"\x00" * 80_000, headers=[("rft-schema", b"1"), ("rft-type", b"experience_group")],
                          check_size=False)
    send_groups(transport.sink(), TOPIC, [make_group("run", 0)])
    taken, skipped, _ = consume(transport, steps=1, per_step=1)
    assert taken == [["run/task-0/e0"]] and skipped == {"dead_letter": 1}
    [dead] = list(transport.source().read_range(DLQ))
    headers = dict(dead.headers)
    assert dead.value == b"" and headers[HEADER_OMITTED] == b"80000"
    assert headers[HEADER_ORIGIN] == f"{TOPIC}:0@0".encode()


def test_the_feed_times_out_and_keeps_what_it_consumed():
    transport = broker()
    fill(transport, GROUPS[:2])
    feed, sink, source = open_feed(transport, topic=TOPIC, dead_letter_topic=DLQ, run_id="run")
    with pytest.raises(FeedTimeout, match="0/3 groups of this batch taken, 2 read into the pool"):
        feed.next_batch(3, timeout_s=0.3)
    assert feed.snapshot().offsets == {f"{TOPIC}:0": 2}


class FlakyTransport:
    """A MemoryTransport whose first source fails on its second poll (a wedged client)."""

    def __init__(self, inner: MemoryTransport):
        self.inner, self.sources, self.claims = inner, 0, inner.claims

    def sink(self, **kwargs):
        return self.inner.sink(**kwargs)

    def source(self, **kwargs):
        source = self.inner.source(**kwargs)
        self.sources += 1
        if self.sources == 1:
            polls, real_poll = [], source.poll

            def poll(timeout_s=1.0, max_records=None):
                polls.append(1)
                if len(polls) == 2:
                    raise TransportError("poll: wedged")
                return real_poll(timeout_s, max_records=2)

            source.poll = poll
        return source


def test_a_failed_source_is_replaced_at_the_feeds_positions():
    transport = fill_and_return(broker())
    flaky = FlakyTransport(transport)
    taken, skipped, _ = consume(flaky, steps=4)
    assert flaky.sources == 2 and sum(taken, []) == [g.group_id for g in GROUPS]
    assert skipped == {"dead_letter": 1, "duplicate": 1, "foreign": 1}


def test_a_replay_window_ends():
    transport = fill_and_return(broker())
    window = ReplayWindow(begin={f"{TOPIC}:0": 0}, stop={f"{TOPIC}:0": 7})  # groups 0-3, garbage, dup, group 4
    feed, sink, source = open_feed(transport, topic=TOPIC, dead_letter_topic=DLQ, run_id=None, window=window)
    assert [g.group_id for g in feed.next_batch(4, timeout_s=0.5).groups] == [g.group_id for g in GROUPS[:4]]
    with pytest.raises(EndOfReplay) as end:
        feed.next_batch(4, timeout_s=0.5)
    assert [g.group_id for g in end.value.batch.groups] == [GROUPS[4].group_id]


def test_dynamic_sampling_refills_each_step_from_the_stream_exactly_once_across_restarts():
    """DAPO's dynamic sampling is `trainer.operators: [zero_variance]`: a group whose rewards all agree is consumed
    and counted (`dropped/zero_variance`), never trained on, and the feed reads on until the step has its
    `groups_per_step` informative groups. Restarted from the saved state after every step, the feed takes the
    same groups, counts each dropped group once (in the step that consumed it: none is read again, none lost), and
    leaves what no step needed unread."""
    from rft.experience.operators import build_operator_chain

    informative = [make_group("run", i, rewards=[0.0, 1.0, float(i % 3) / 2, 1.0]) for i in range(9)]
    flat = [make_group("run", 100 + i, rewards=[float(i % 2)] * 4) for i in range(7)]
    pick = {"I": iter(informative), "F": iter(flat)}
    # steps of 3: [F I I F F I] [F I I I] [I F I F I] and a flat group that no step needs
    layout = "FIIFFI" + "FIII" + "IFIFI" + "F"
    transport = broker()
    fill(transport, [next(pick[kind]) for kind in layout])
    expected_drops = [3, 1, 2]

    whole, skipped, state = consume(transport, steps=3, operators=build_operator_chain(["zero_variance"]))
    assert whole == [[g.group_id for g in informative[i:i + 3]] for i in (0, 3, 6)]
    assert skipped == {"dropped/zero_variance": sum(expected_drops)}
    assert state.offsets == {f"{TOPIC}:0": len(layout) - 1} and state.taken_groups == sum(whole, [])

    state, resumed = None, []
    for drops in expected_drops:  # a checkpoint after every step: a new feed (and chain) from the saved state
        taken, skipped, state = consume(transport, steps=1, state=state,
                                        operators=build_operator_chain(["zero_variance"]))
        resumed += taken
        assert skipped == {"dropped/zero_variance": drops}
    assert resumed == whole and state.offsets == {f"{TOPIC}:0": len(layout) - 1}


def failed(group, positions: dict[int, str], *, empty: bool = False):
    """`group` with the samples at `positions` failed (their class), optionally with an empty response."""
    import numpy as np
    for j, failure in positions.items():
        sample = group.samples[j]
        sample.failure, sample.reward = failure, 0.0
        if empty:
            sample.response_tokens = np.zeros(0, dtype=np.int32)
            sample.logprobs, sample.loss_mask = np.zeros(0, dtype=np.float32), np.zeros(0, dtype=np.uint8)
    return group


def test_failed_samples_leave_their_group_before_anything_sees_it_and_are_counted_per_class():
    from rft.schema import decode_group
    transport = broker()
    partial = failed(make_group("run", 0, rewards=[1.0, 0.0, 0.0, 1.0]), {1: "timeout", 2: "verifier"}, empty=True)
    lost = failed(make_group("run", 1, rewards=[1.0, 0.0, 0.0, 1.0]), {0: "timeout", 1: "timeout", 2: "sandbox"})
    intact = make_group("run", 2)
    single = failed(make_group("run", 3, rewards=[1.0]), {0: "environment"})  # a group of one, all failed
    fill(transport, [partial, lost, intact, single, make_group("run", 4)])
    checked = []

    def check(group):  # the trainer's check: an empty response would dead-letter the group
        checked.append(group.group_id)
        return "empty response" if any(len(s.response_tokens) == 0 for s in group.samples) else None

    feed, sink, source = open_feed(transport, topic=TOPIC, dead_letter_topic=DLQ, run_id="run", check=check)
    try:
        batch = feed.next_batch(3, timeout_s=0.5)
    finally:
        sink.close()
        source.close()
    assert [g.group_id for g in batch.groups] == [partial.group_id, intact.group_id, make_group("run", 4).group_id]
    kept = batch.groups[0]
    assert [s.sample_index for s in kept.samples] == [0, 3] and all(s.scored for s in kept.samples)
    assert [s.sample_index for s in decode_group(batch.messages[0].value).samples] == [0, 3]  # what other ranks get
    assert len(batch.groups[1].samples) == 4  # untouched
    assert batch.skipped == {"too_few_scored": 2}  # 1 scored of 4 < 2; 0 of 1 < 1
    assert batch.failed == {"timeout": 3, "verifier": 1, "sandbox": 1, "environment": 1}
    assert lost.group_id not in checked and single.group_id not in checked


def test_min_scored_samples_sets_how_many_scored_samples_a_group_needs():
    transport = broker()
    fill(transport, [failed(make_group("run", 0, rewards=[1.0, 0.0, 0.0, 1.0]), {0: "timeout", 1: "agent"}),
                     make_group("run", 1)])
    taken, skipped, _ = consume(transport, steps=1, per_step=1, min_scored=3)
    assert taken == [[make_group("run", 1).group_id]] and skipped == {"too_few_scored": 1}
