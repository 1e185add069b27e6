"""The Kafka names of one run: its topics (`Config.topic(kind)`, `<prefix>.<kind>`, the prefix defaulting to the
run name), the explorers' consumer group on the tasks topic, and the creation of the run's topics.

Invariant: every process of a run derives these names from the same config, so a trainer, explorers and a
publisher started separately (Slurm, Ray) meet on the same topics and the explorers share one group.
"""
from __future__ import annotations

from contextlib import closing

from rft.config import Config
from rft.transport import Transport, connect

RUN_TOPICS = ("tasks", "control", "dead_letter")  # kafka.partitions each; experiences: kafka.experience_partitions


def consumer_group(cfg: Config) -> str:
    """The explorers' consumer group on the tasks topic: `<run>.explorers` (`<topic prefix>.explorers`)."""
    return f"{cfg.kafka.topic_prefix or cfg.run.name}.explorers"


def create_run_topics(cfg: Config, transport: Transport | None = None) -> None:
    """Create a run's topics where missing: tasks, control, dead letters (kafka.partitions) and experiences
    (kafka.experience_partitions). `rft run` and `rft publish` call it, so trainers and explorers started on
    their own (Slurm, Ray) find every topic. `transport` defaults to the run's Kafka."""
    transport = transport or connect(cfg.kafka)
    with closing(transport.admin()) as admin:
        admin.create_topics([cfg.topic(kind) for kind in RUN_TOPICS])
        admin.create_topics([cfg.topic("experiences")], partitions=cfg.kafka.experience_partitions)
