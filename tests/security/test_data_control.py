"""Issue 54, item 3: control messages are checked like records. Forged messages on a real broker's control topic are
ignored and counted (`ControlView.malformed`), never fatal, and the reader keeps working:
- a `weights` announcement of version 10^8 (past what a store's 8-digit version directories name) is refused at
  decode, and the next real announcement is still loaded;
- a trainer message stamped far in the future (it would hold the trainer's state for good) is refused;
- a `tasks_group` move that skips epochs is refused (also when a starting explorer replays the topic), and a move
  to the next epoch whose group nobody seeded (its members would read the tasks topic from the earliest offset) is
  not followed until its group holds the fleet's positions;
- `rft serve`'s engine thread keeps serving through a forged announcement, and `/health` answers 503 with the reason
  once the thread died (it said ok before), as every request does.
"""
from __future__ import annotations

import time

import httpx
import pytest
import torch

from rft.explorer import membership as membership_module
from rft.explorer.config import ExplorerConfig
from rft.explorer.membership import Membership, announced_group, group_name, move_group, seed_group
from rft.explorer.stats import ExplorerStats
from rft.schema import ControlMessage, RewardRange
from rft.serve.app import ServerThread
from rft.serve.engine_thread import EngineWorker
from rft.serve.ledger import FeedbackLedger
from rft.serve.service import ServeService
from rft.transport import connect
from rft.transport.config import KafkaConfig
from rft.transport.control import TasksGroup, TrainerWaiting, Weights
from rft.transport.run_topics import RunTopics, create_run_topics
from rft.weights.store import WeightStore
from rft.weights.subscriber import WeightUpdates
from tests.waiting import wait_until

pytestmark = [pytest.mark.integration]


def run_topics(prefix: str) -> RunTopics:
    return RunTopics(run=prefix, tasks=f"{prefix}.tasks", experiences=f"{prefix}.experiences",
                     control=f"{prefix}.control", dead_letter=f"{prefix}.dead_letter",
                     explorers_group=f"{prefix}.explorers")


def control_reader(transport, topic: str):
    source = transport.source(client_id="reader")
    source.assign([topic])
    source.seek(source.beginning_offsets(topic))
    return source


def test_forged_weights_and_trainer_messages_are_ignored_and_counted(bootstrap, topic_prefix, tmp_path):
    cfg = KafkaConfig(partitions=1)
    transport = connect(cfg, bootstrap)
    topics = run_topics(topic_prefix)
    create_run_topics(topics, cfg, transport)
    store = WeightStore(tmp_path / "store", keep=5)
    store.publish(1, [{"a.weight": torch.ones(2, 2)}], hf_dir=None)
    sink = transport.sink(linger_ms=0)
    forged = [Weights(version=10**8, path=store.location(10**8)).to_message(),  # what raised in every reader
              ControlMessage("weights", "trainer", {"version": 2**63, "path": store.location(1)}),
              TrainerWaiting(version=1).to_message(created_at=time.time() + 10**7)]  # would freeze the trainer view
    for message in forged:
        sink.send_record(topics.control, message)
    sink.flush()
    updates = WeightUpdates(store, control_reader(transport, topics.control))
    try:
        wait_until(lambda: updates.newest(above=0) and updates.view.malformed == 3, timeout=10,
                   what="the forged messages read")
        assert updates.newest(above=0) == (1, store.path(1)) and updates.view.announced is None
        path = store.publish(2, [{"a.weight": torch.full((2, 2), 2.0)}], hf_dir=None)
        sink.send_record(topics.control, Weights(version=2, path=str(path)).to_message())
        sink.flush()
        # the real announcement after the forged ones is read and taken
        wait_until(lambda: updates.newest(above=1) and updates.view.trainer.version == 2, timeout=10,
                   what="version 2 announced")
        assert updates.view.announced.version == 2 and updates.view.malformed == 3
    finally:
        updates.close()
        sink.close()


def test_a_forged_tasks_group_move_does_not_move_the_fleet(bootstrap, topic_prefix, tmp_path, monkeypatch):
    monkeypatch.setattr(membership_module, "RECHECK_MOVE_S", 0.0)
    cfg = KafkaConfig(partitions=1)
    transport = connect(cfg, bootstrap)
    topics = run_topics(topic_prefix)
    create_run_topics(topics, cfg, transport)
    sink = transport.sink(linger_ms=0)
    for i in range(6):
        sink.send(topics.tasks, b"task %d" % i)
    positions = {f"{topics.tasks}:0": 4}
    assert seed_group(transport, topics.explorers_group, topics.tasks, positions, client_id="fleet")
    # the attack: a far epoch, then the next epoch in a group nobody seeded (it would start from offset 0)
    sink.send_record(topics.control, TasksGroup(explorer_id="mallory", group="x", epoch=9999).to_message())
    sink.send_record(topics.control, TasksGroup(explorer_id="mallory", group="x", epoch=1).to_message())
    sink.flush()
    assert announced_group(transport, topics.control, client_id="probe").epoch == 1  # the far epoch was refused

    control = WeightUpdates(WeightStore(tmp_path / "store"), control_reader(transport, topics.control))
    member = Membership(transport=transport, topics=topics, explorer_id="e0", config=ExplorerConfig(),
                        kafka=cfg, control=control, sink=sink, stats=ExplorerStats())
    try:
        member.epoch = 0
        member._subscribe(static=False)  # the explorer in the group in force (epoch 0) before the forged move
        wait_until(lambda: control.read_announcements() or control.view.tasks_group, timeout=10,
                   what="the forged moves read")
        assert control.view.malformed == 1 and control.view.tasks_group.epoch == 1
        assert not member.watch() and member.epoch == 0  # the unseeded group would rewind the fleet: not followed
        assert control.view.malformed == 2
        # the real move (the watchdog's, or a restart's) seeds the group first: then the fleet follows
        move_group(transport, topics, epoch=1, offsets=positions, by="e1", sink=sink)
        assert member.watch() and member.epoch == 1 and member.group == group_name(topics.explorers_group, 1)
        assert control.view.malformed == 2
    finally:
        if member.tasks is not None:
            member.tasks.close()
        control.close()
        sink.close()


class EngineLost(BaseException):
    """What ends a thread past every handler (the engine thread's contract: /health must say so)."""


class StandInEngine:
    """The part of rft.engine.Engine the serve engine thread uses before generating: a weights version it loads."""

    def __init__(self):
        self.version, self.lost = 0, False

    @property
    def weights_version(self) -> int:
        return self.version

    def load_weights(self, path, version: int) -> None:
        self.version = version

    def close(self) -> None:
        pass


def test_serve_survives_a_forged_announcement_and_health_reports_a_dead_engine_thread(bootstrap, topic_prefix,
                                                                                     tmp_path):
    cfg = KafkaConfig(partitions=1)
    transport = connect(cfg, bootstrap)
    topics = run_topics(topic_prefix)
    create_run_topics(topics, cfg, transport)
    store = WeightStore(tmp_path / "store")
    store.publish(1, [{"a.weight": torch.ones(2, 2)}], hf_dir=None)
    sink = transport.sink(linger_ms=0)
    sink.send_record(topics.control, Weights(version=10**8, path=store.location(10**8)).to_message())
    sink.flush()
    updates = WeightUpdates(store, control_reader(transport, topics.control))
    engine = StandInEngine()

    def newest(above: int):
        if engine.lost:
            raise EngineLost("the device is gone")
        return updates.newest(above=above)

    worker = EngineWorker(lambda: engine, newest=newest)
    service = ServeService(worker=worker, sink=sink, ledger=FeedbackLedger(60), topics=topics, model_name="m",
                           max_tokens=4, tokenize=lambda messages: [1, 2], rewards=RewardRange())
    worker.start()
    thread = ServerThread(service).start()
    try:
        wait_until(lambda: updates.view.malformed == 1 and engine.version == 1, timeout=10,
                   what="the forged announcement read and refused, version 1 loaded")
        assert httpx.get(thread.url + "/health", timeout=10).json()["status"] == "ok"
        engine.lost = True  # the engine thread ends on its next look for weights
        wait_until(lambda: worker.died, timeout=10, what="the engine thread's end")
        health = httpx.get(thread.url + "/health", timeout=10)
        assert health.status_code == 503 and "EngineLost: the device is gone" in health.json()["error"], health.text
        chat = httpx.post(thread.url + "/v1/chat/completions", timeout=10,
                          json={"model": "m", "messages": [{"role": "user", "content": "hi"}]})
        assert chat.status_code == 503 and "engine thread died" in chat.json()["error"]["message"], chat.text
    finally:
        thread.stop()
        service.close()
        updates.close()
