"""The online task publisher, for selectors that read rewards (`data.selector: curriculum`).

It keeps at most `data.tasks_ahead` tasks on the tasks topic that the explorers have not yet finished (the lag of
the consumer group `<run>.explorers`: end offsets minus committed offsets), and picks each next task from the
reward statistics read so far from the experiences topic (rft/explorer/selectors.py). It owns no state of its
own: on (re)start, `restore()` counts what the tasks topic holds and reads every recorded experience, so a
restarted publisher continues the sequence. It stops when every task set is used up, or when asked to.

`rft publish CONFIG` runs it in the foreground (SIGTERM/Ctrl-C stop it cleanly); `rft run` starts that command
as its `publisher` part when the selector needs it.
"""
from __future__ import annotations

import logging
import signal
import threading

from rft.config import Config
from rft.explorer.selectors import RewardStats, TaskPicker
from rft.explorer.tasks import build_picker, ensure_tasks_topic
from rft.schema import RecordError, TaskRecord, decode_group, decode_task
from rft.run_topics import consumer_group
from rft.transport import Transport, connect

log = logging.getLogger("rft.publisher")

POLL_S = 0.5  # longest wait for new experiences between two looks at the explorers' lag


def tasks_ahead(cfg: Config) -> int:
    return cfg.data.tasks_ahead or max(1, 2 * cfg.explorer.replicas * cfg.explorer.tasks_per_batch)


class OnlinePublisher:
    def __init__(self, cfg: Config, bootstrap: str | None = None, *, transport: Transport | None = None):
        self.cfg = cfg
        self.bootstrap = bootstrap or cfg.kafka.bootstrap_servers
        self.transport = transport or connect(cfg.kafka, self.bootstrap)
        self.picker: TaskPicker = build_picker(cfg)
        self.stats = RewardStats(run_id=cfg.run.name)
        self.ahead = tasks_ahead(cfg)
        self.topic = ensure_tasks_topic(cfg, self.bootstrap)
        self.group = consumer_group(cfg)
        self._ends: dict[str, int] = {}  # tasks topic: next offset per partition, from the broker's acks
        self._starts: dict[str, int] = {}
        self.sink = self.transport.sink(client_id=f"{cfg.run.name}-publisher")
        self.admin = self.transport.admin()
        self.admin.create_topics([cfg.topic("experiences")], partitions=cfg.kafka.experience_partitions)
        self.rewards = self.transport.source(client_id=f"{cfg.run.name}-publisher-rewards")

    # -- state, rebuilt from the topics
    def restore(self) -> None:
        """Count the tasks already published and read every experience recorded so far."""
        source = self.transport.source(client_id=f"{self.cfg.run.name}-publisher-restore")
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
        experiences = self.cfg.topic("experiences")
        self.rewards.assign([experiences])
        self.rewards.seek(self.rewards.beginning_offsets(experiences))
        self.sync_rewards()

    def sync_rewards(self) -> int:
        """Read every experience recorded up to now (the topic's current end); returns how many groups were new."""
        experiences = self.cfg.topic("experiences")
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
                added += self.stats.add(decode_group(m.value, m.headers))
            except RecordError:
                continue  # the trainer dead-letters it; it carries no reward the publisher could use
        return added

    # -- publishing
    def backlog(self) -> int:
        """Tasks published that the explorers have not committed (consumer-group lag on the tasks topic)."""
        committed = self.admin.group_offsets(self.group)
        return sum(max(0, end - max(committed.get(k, -1), self._starts.get(k, 0))) for k, end in self._ends.items())

    def publish(self, n: int) -> list[TaskRecord]:
        """Pick and send up to `n` tasks; returns them once the broker has acknowledged every one."""
        tasks = []
        while len(tasks) < n and (task := self.picker.next(self.stats)) is not None:
            tasks.append(task)
        futures = [self.sink.send_record(self.topic, t, key=t.task_id) for t in tasks]
        self.sink.flush()
        for future in futures:
            meta = future.get(timeout=self.cfg.kafka.request_timeout_ms / 1000)
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
        self.rewards.close()
        self.admin.close()
        self.sink.close()


def serve(cfg: Config) -> int:
    """`rft publish` for an online selector: restore, then publish until done or SIGTERM / Ctrl-C."""
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    publisher = OnlinePublisher(cfg)
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
