"""The Kafka names of one run: its topics (`Config.topic(kind)`, `<prefix>.<kind>`, the prefix defaulting to the
run name), the explorers' consumer group on the tasks topic, and the creation of the run's topics.

`RunTopics` is the run's identity as components see it (the run name and these names): a component that reads
or writes the run's topics takes a `RunTopics`, never the root config; entry points build it with `RunTopics.of`.

Invariant: every process of a run derives these names from the same config, so a trainer, explorers and a
publisher started separately (Slurm, Ray) meet on the same topics and the explorers share one group.
"""
from __future__ import annotations

from contextlib import closing
from dataclasses import dataclass
from typing import TYPE_CHECKING

from rft.transport import Transport, connect
from rft.transport.config import KafkaConfig

if TYPE_CHECKING:
    from rft.run.config import Config  # the root, read by the composition that builds RunTopics

RUN_TOPICS = ("tasks", "control", "dead_letter")  # kafka.partitions each; experiences: kafka.experience_partitions


def consumer_group(cfg: Config) -> str:
    """The explorers' consumer group on the tasks topic: `<run>.explorers` (`<topic prefix>.explorers`)."""
    return f"{cfg.kafka.topic_prefix or cfg.run.name}.explorers"


@dataclass(frozen=True)
class RunTopics:
    """One run's name and Kafka names: `run` (`run.name`: the run id of its records, the prefix of its client
    ids), its four topics and the explorers' consumer group."""
    run: str
    tasks: str
    experiences: str
    control: str
    dead_letter: str
    explorers_group: str
    served: str = ""  # serve mode: completions `rft serve` answered (rft/serve/)
    feedback: str = ""  # serve mode: their rewards

    @classmethod
    def of(cls, cfg: Config) -> RunTopics:
        """The names `cfg` gives its run (`Config.topic`, `consumer_group`)."""
        return cls(run=cfg.run.name, tasks=cfg.topic("tasks"), experiences=cfg.topic("experiences"),
                   control=cfg.topic("control"), dead_letter=cfg.topic("dead_letter"),
                   explorers_group=consumer_group(cfg), served=cfg.topic("served"), feedback=cfg.topic("feedback"))


def create_run_topics(topics: RunTopics, kafka: KafkaConfig, transport: Transport | None = None) -> None:
    """Create a run's topics where missing: tasks, control, dead letters (kafka.partitions) and experiences
    (kafka.experience_partitions). `rft run` and `rft publish` call it, so trainers and explorers started on
    their own (Slurm, Ray) find every topic. `transport` defaults to the run's Kafka."""
    transport = transport or connect(kafka)
    with closing(transport.admin()) as admin:
        admin.create_topics([getattr(topics, kind) for kind in RUN_TOPICS])
        admin.create_topics([topics.experiences], partitions=kafka.experience_partitions)
