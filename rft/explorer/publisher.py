"""The online task publisher, for selectors that read rewards (`data.selector: curriculum`).

It keeps at most `data.tasks_ahead` tasks on the tasks topic that the explorers have not yet finished (the lag of
the explorers' consumer group, `<run>.explorers` or the group their membership watchdog moved them to: end offsets
minus committed offsets), and picks each next task from the
reward statistics read so far from the experiences topic (rft/data/selectors.py). It owns no state of its
own: on (re)start, `restore()` counts what the tasks topic holds and reads every recorded experience, so a
restarted publisher continues the sequence. It stops when every task set is used up, or when asked to.

`rft publish CONFIG` (`main` here) runs it in the foreground (SIGTERM/Ctrl-C stop it cleanly); `rft run` starts
that command as its `publisher` part when the selector needs it. For a selector that reads no rewards, `rft publish`
publishes the whole sequence at once (`rft.data.tasks.publish_tasks`).
"""
from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading

from rft.cli.commandline import add_config_arguments, config_from_args
from rft.data.config import DataConfig
from rft.data.selectors import RewardStats, TaskPicker, selector_needs_rewards
from rft.data.tasks import DatasetError, build_picker, ensure_tasks_topic, publish_tasks
from rft.explorer.config import ExplorerConfig
from rft.explorer.membership import GroupFollower
from rft.run.config import Config
from rft.run.records import run_transport
from rft.schema import RecordError, TaskRecord, decode_group, decode_task
from rft.transport import Transport, connect, resolve_claims
from rft.transport.config import KafkaConfig
from rft.transport.run_topics import RunTopics, create_run_topics

log = logging.getLogger("rft.publisher")

POLL_S = 0.5  # longest wait for new experiences between two looks at the explorers' lag


def tasks_ahead(data: DataConfig, explorer: ExplorerConfig) -> int:
    """How many unfinished tasks the publisher keeps on the tasks topic: `data.tasks_ahead`, default
    2 x replicas x tasks_per_batch."""
    return data.tasks_ahead or max(1, 2 * explorer.replicas * explorer.tasks_per_batch)


class OnlinePublisher:
    """Publishes `data`'s task sets to `topics.tasks`, `tasks_ahead(data, explorer)` ahead of the explorers."""

    def __init__(self, data: DataConfig, explorer: ExplorerConfig, topics: RunTopics, kafka: KafkaConfig, *,
                 bootstrap: str | None = None, transport: Transport | None = None):
        self.topics, self.kafka = topics, kafka
        self.bootstrap = bootstrap or kafka.bootstrap_servers
        self.transport = transport or connect(kafka, self.bootstrap)
        self.picker: TaskPicker = build_picker(data, run_id=topics.run)
        self.stats = RewardStats(run_id=topics.run)
        self.ahead = tasks_ahead(data, explorer)
        self.topic = ensure_tasks_topic(topics, kafka, self.bootstrap)
        self._ends: dict[str, int] = {}  # tasks topic: next offset per partition, from the broker's acks
        self._starts: dict[str, int] = {}
        self.sink = self.transport.sink(client_id=f"{topics.run}-publisher")
        self.admin = self.transport.admin()
        self.admin.create_topics([topics.experiences], partitions=kafka.experience_partitions)
        self.admin.create_topics([topics.control])
        self.groups = GroupFollower(self.transport, topics.explorers_group, topics.control,
                                    client_id=f"{topics.run}-publisher-groups")  # the explorers may move group
        self.rewards = self.transport.source(client_id=f"{topics.run}-publisher-rewards")

    # -- state, rebuilt from the topics
    def restore(self) -> None:
        """Count the tasks already published and read every experience recorded so far."""
        source = self.transport.source(client_id=f"{self.topics.run}-publisher-restore")
        try:
            begin, stop = source.replay_bounds(self.topic)
            for m in source.read_offsets(begin, stop):
                try:
                    self.picker.record(decode_task(m.value, m.headers).task_id)
                except RecordError as e:
                    log.warning("tasks topic %s@%d: not a task (%s); not counted", m.position, m.offset, e)
        finally:
            source.close()
        self._starts, self._ends = begin, stop
        if self.picker.unknown:
            log.warning("%d published tasks are not in the configured task sets (data changed?)", self.picker.unknown)
        experiences = self.topics.experiences
        self.rewards.assign([experiences])
        self.rewards.seek(self.rewards.beginning_offsets(experiences))
        self.sync_rewards()

    def sync_rewards(self) -> int:
        """Read every experience recorded up to now (the topic's current end); returns how many groups were new."""
        experiences = self.topics.experiences
        stop = self.rewards.end_offsets(experiences)
        added = 0
        while any(self.rewards.positions().get(k, 0) < end for k, end in stop.items()):
            added += self.poll_rewards(POLL_S, until=stop)
        return added

    def poll_rewards(self, timeout_s: float = POLL_S, until: dict[str, int] | None = None) -> int:
        """Take what has arrived on the experiences topic (before `until`, when given); returns the new groups."""
        added = 0
        for m in self.rewards.poll(timeout_s=timeout_s):
            if until is not None and m.offset >= until.get(m.position, 0):
                self.rewards.seek({m.position: m.offset})  # read again by the next sync or poll
                continue
            try:
                inline = resolve_claims(m, self.transport.claims)
                added += self.stats.add(decode_group(inline.value, inline.headers))
            except RecordError:
                continue  # the trainer dead-letters it; it carries no reward the publisher could use
        return added

    # -- publishing
    def backlog(self) -> int:
        """Tasks published that the explorers have not committed (consumer-group lag on the tasks topic)."""
        committed = self.admin.group_offsets(self.groups.group)
        return sum(max(0, end - max(committed.get(k, -1), self._starts.get(k, 0))) for k, end in self._ends.items())

    def publish(self, n: int) -> list[TaskRecord]:
        """Pick and send up to `n` tasks; returns them once the broker has acknowledged every one."""
        tasks: list[TaskRecord] = []
        while len(tasks) < n and (task := self.picker.next(self.stats)) is not None:
            tasks.append(task)
        futures = [self.sink.send_record(self.topic, t, key=t.task_id) for t in tasks]
        self.sink.flush()
        for future in futures:
            meta = future.get(timeout=self.kafka.request_timeout_ms / 1000)
            key = f"{meta.topic}:{meta.partition}"
            self._ends[key] = max(self._ends.get(key, 0), meta.offset + 1)
        return tasks

    def run(self, stop: threading.Event) -> int:
        """Publish until every set is used up or `stop` is set; returns how many tasks this call published."""
        published = 0
        while not stop.is_set() and self.picker.remaining:
            room = self.ahead - self.backlog()
            if room > 0:
                published += len(self.publish(room))
            self.poll_rewards(POLL_S)
        return published

    def close(self) -> None:
        self.groups.close()
        self.rewards.close()
        self.admin.close()
        self.sink.close()


def serve(cfg: Config) -> int:
    """`rft publish` for an online selector: restore, then publish until done or SIGTERM / Ctrl-C."""
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    publisher = OnlinePublisher(cfg.data, cfg.explorer, RunTopics.of(cfg), cfg.kafka, transport=run_transport(cfg))
    try:
        publisher.restore()
        print(f"[publisher] {publisher.picker.picks} tasks already on {publisher.topic}, rewards of "
              f"{publisher.stats.groups} groups recorded; keeping {publisher.ahead} ahead of the explorers", flush=True)
        published = publisher.run(stop)
    finally:
        publisher.close()
    reason = "stopped" if stop.is_set() else "every task set is used up"
    print(f"[publisher] {reason} after {published} tasks", flush=True)
    return published


def main(argv: list[str]) -> int:
    """`rft publish CONFIG`: create the run's topics, then publish its tasks (online when the selector reads
    rewards, `serve`; else the whole sequence at once)."""
    parser = argparse.ArgumentParser(prog="rft publish", description="Publish a dataset's tasks to the run's "
                                     "tasks topic: at once, or online for a selector that reads rewards "
                                     "(curriculum) until the sequence ends or SIGTERM.")
    add_config_arguments(parser)
    cfg = config_from_args(parser.parse_args(argv), joins_broker="rft publish")
    topics = RunTopics.of(cfg)
    try:
        create_run_topics(topics, cfg.kafka)  # a trainer or explorers started separately find every topic of the run
        if selector_needs_rewards(cfg.data):
            count = serve(cfg)
        else:
            count = publish_tasks(cfg.data, topics, cfg.kafka, progress=cfg.monitor.progress)
    except DatasetError as e:
        print(f"rft publish: {e}", file=sys.stderr)
        return 2
    print(f"published {count} tasks to {topics.tasks}")
    return 0
