"""A restarted run's explorers start in a fresh consumer group (rft/explorer/membership.py fresh_group_for_restart,
called by `rft run` before it starts them), on the real broker: nothing happens on a run's first start; after the
explorers' group committed positions, each restart seeds the next epoch's group with those positions and announces
it on the control topic, where a starting explorer reads it (announced_group). The whole run, restarted after a
trainer kill, with no watchdog move: tests/e2e/test_chaos.py."""
from __future__ import annotations

from rft.explorer.membership import announced_group, fresh_group_for_restart, group_name, seed_group
from rft.transport import connect
from rft.transport.config import KafkaConfig
from rft.transport.run_topics import RunTopics, create_run_topics


def test_each_restart_moves_the_explorers_to_a_fresh_group_seeded_with_their_positions(bootstrap, topic_prefix):
    cfg = KafkaConfig(partitions=2)
    transport = connect(cfg, bootstrap)
    run = topic_prefix
    topics = RunTopics(run=run, tasks=f"{run}.tasks", experiences=f"{run}.experiences", control=f"{run}.control",
                       dead_letter=f"{run}.dead_letter", explorers_group=f"{run}.explorers")
    create_run_topics(topics, cfg, transport)
    sink = transport.sink(linger_ms=0)
    for i in range(10):
        sink.send(topics.tasks, b"task %d" % i, partition=i % 2)
    sink.flush()

    # the first start: the group has committed nothing, so no move and no announcement
    assert fresh_group_for_restart(transport, topics, by="rft-run") is None
    assert announced_group(transport, topics.control, client_id="probe") is None

    # the explorers consumed some tasks; then the run restarts, twice
    positions = {f"{topics.tasks}:0": 3, f"{topics.tasks}:1": 2}
    assert seed_group(transport, topics.explorers_group, topics.tasks, positions, client_id="explorers")
    for epoch in (1, 2):
        assert fresh_group_for_restart(transport, topics, by="rft-run") == group_name(topics.explorers_group, epoch)
        announced = announced_group(transport, topics.control, client_id="probe")
        assert (announced.epoch, announced.group, announced.explorer_id) == (
            epoch, f"{run}.explorers.{epoch}", "rft-run")
        assert announced.offsets == positions
        source = transport.source(group=announced.group, client_id="probe")
        try:
            assert source.committed(topics.tasks) == positions  # the explorers go on where the old group was
        finally:
            source.close()
    sink.close()
