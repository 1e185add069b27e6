"""The continuous loop (rft/explorer/continuous.py `ContinuousLoop`) over the in-memory transport, no broker and no
inference engine (stand-ins of our own Engine and Workflow protocols, as in test_explorer_loop_memory.py): requests
finish out of order (each after as many steps as its prompt says), a version published mid-run is loaded only when
no request is unfinished, every group carries the version its request ran with, and no commit passes a task whose
group was not yet produced. The real-engine version is tests/integration/test_explorer_continuous.py."""
from __future__ import annotations

import threading

from rft.engine import Completion, Generation
from rft.explorer.admission import StalenessAdmission
from rft.explorer.config import ExplorerConfig
from rft.explorer.explorer import Explorer
from rft.rewards.registry import RewardResult
from rft.schema import TaskRecord, decode_group
from rft.transport.config import KafkaConfig
from rft.transport.memory import MemoryTransport
from rft.transport.run_topics import create_run_topics
from rft.weights.config import SyncConfig
from rft.weights.store import WeightStore
from rft.workflows import GroupResult, build_sample
from tests.records import read_topic
from tests.unit.test_explorer_loop_memory import TOPICS, publish


class StreamingEngine:
    """Request-level engine in memory: a request of prompt [k] finishes k steps after it was submitted."""

    def __init__(self):
        self.weights_version, self.loaded, self.steps = 0, [], 0
        self.pending: dict[str, tuple[int, list[int], int]] = {}  # request -> (due step, prompt, version)
        self.on_step = lambda: None

    def load_weights(self, path, version: int) -> None:
        self.loaded.append((version, len(self.pending)))
        self.weights_version = version

    def submit(self, request_id, prompt, sampling) -> None:
        self.pending[request_id] = (self.steps + prompt[0], list(prompt), self.weights_version)

    def step(self):
        self.steps += 1
        done = sorted((r for r, (due, _, _) in self.pending.items() if due <= self.steps), reverse=True)
        out = []
        for r in done:
            _, prompt, version = self.pending.pop(r)
            out.append((r, Generation(prompt, [Completion([5], [-0.1], "x", "stop", version)])))
        self.on_step()
        return out


class StreamingWorkflow:
    sampling = None

    def prepare(self, task, engine):
        return "cannot be explored" if task.prompt == "cannot" else [int(task.prompt)]

    def finish(self, task, generation):
        c = generation.completions[0]
        sample = build_sample(0, prompt=generation.prompt_token_ids, tokens=c.token_ids, logprobs=c.logprobs,
                              loss_mask=[1], reward=RewardResult(1.0), finish_reason=c.finish_reason)
        return GroupResult(task, samples=[sample], policy_version=c.weights_version)


def test_continuous_loop_out_of_order(tmp_path, monkeypatch):
    monkeypatch.setattr("rft.explorer.continuous.WEIGHTS_CHECK_S", 0.0)  # look for new weights at every step
    transport = MemoryTransport(partitions=2)
    kafka = KafkaConfig(bootstrap_servers="memory", partitions=2)
    create_run_topics(TOPICS, kafka, transport)
    store = WeightStore(tmp_path / "store")
    durations = [5, 1, 3, 1, 4, 2, 1, 6, 2, 1, 3, 1, 2, 5, 1, 1]
    tasks = [TaskRecord(run_id="run", task_id=f"t{i}", epoch=0, prompt=str(d)) for i, d in enumerate(durations)]
    bad = TaskRecord(run_id="run", task_id="bad", epoch=0, prompt="cannot")
    sink = transport.sink()
    for t in tasks[:5] + [bad] + tasks[5:]:
        sink.send_record(TOPICS.tasks, t, key=t.task_id)

    engine, workflow = StreamingEngine(), StreamingWorkflow()
    explorer = Explorer(ExplorerConfig(engine="vllm", continuous=True, max_inflight=3, heartbeat_s=60), kafka=kafka,
                        sync=SyncConfig(), topics=TOPICS, store=store, explorer_id="c1", engine=engine,
                        workflow=workflow, transport=transport)
    produced: list[str] = []
    commits: list[tuple[dict, set]] = []
    send = explorer.sink.send_record

    def recorded_send(topic, record, *, key=None):
        produced.append(key)
        return send(topic, record, key=key)

    explorer.sink.send_record = recorded_send
    engine.on_step = lambda: publish(store, 1) if engine.steps == 6 else None
    try:
        explorer.refresh_weights()
        explorer.join()
        commit = explorer.tasks.commit
        explorer.tasks.commit = lambda offsets: (commits.append((dict(offsets), set(produced))), commit(offsets))[1]
        assert explorer.run_continuous(threading.Event(), exit_when_idle_s=0.5) == "idle"
    finally:
        explorer.close("stopped")

    groups = [decode_group(m.value) for m in read_topic(transport, TOPICS.experiences)]
    assert sorted(g.task_id for g in groups) == sorted(t.task_id for t in tasks)
    assert engine.loaded == [(1, 0)] and explorer.reloads == [(1, 0)]  # loaded with nothing in flight
    assert {g.policy_version for g in groups} == {0, 1}
    for g in groups:
        assert g.metadata["submitted_version"] == g.metadata["finished_version"] == g.policy_version
    finish_order = [g.task_id for g in groups]
    assert finish_order != sorted(finish_order, key=lambda t: int(t[1:]))  # really out of order

    # every commit: all tasks below the committed offset were produced before it (the bad one: dead-lettered)
    by_offset = {(m.position, m.offset): decode_task_id(m) for m in read_topic(transport, TOPICS.tasks)}
    group_of = {t.task_id: t.group_id for t in tasks}
    for offsets, sent in commits:
        for position, upto in offsets.items():
            below = [by_offset[(position, o)] for o in range(upto)]
            assert all(t == "bad" or group_of[t] in sent for t in below), (offsets, below)
    source = transport.source(group=TOPICS.explorers_group, topics=[TOPICS.tasks])
    assert source.committed(TOPICS.tasks) == source.end_offsets(TOPICS.tasks)
    assert len(commits) > 2


def decode_task_id(m) -> str:
    from rft.schema import decode_task
    return decode_task(m.value, m.headers).task_id


def test_continuous_loop_gives_back_the_admission_slots_of_dead_lettered_tasks(tmp_path):
    """A malformed record and a foreign run's task are admitted, then dead-lettered at decoding: their admission slots
    are given back (`fail`), as in the batch loop. With at most 2 tasks running, two slots kept by them would stop the
    explorer for good."""
    transport = MemoryTransport(partitions=1)
    kafka = KafkaConfig(bootstrap_servers="memory", partitions=1)
    create_run_topics(TOPICS, kafka, transport)
    sink = transport.sink()
    sink.send(TOPICS.tasks, b"\x93not a task", headers=[("rft-schema", b"1"), ("rft-type", b"task")])
    foreign = TaskRecord(run_id="other", task_id="x", epoch=0, prompt="1")
    sink.send_record(TOPICS.tasks, foreign, key=foreign.task_id)
    tasks = [TaskRecord(run_id="run", task_id=f"t{i}", epoch=0, prompt="1") for i in range(4)]
    for t in tasks:
        sink.send_record(TOPICS.tasks, t, key=t.task_id)

    admission = StalenessAdmission(groups_per_step=1, max_staleness=None, max_running=2)
    explorer = Explorer(ExplorerConfig(engine="vllm", continuous=True, max_inflight=2, heartbeat_s=60), kafka=kafka,
                        sync=SyncConfig(), topics=TOPICS, store=WeightStore(tmp_path / "store"), explorer_id="c2",
                        engine=StreamingEngine(), workflow=StreamingWorkflow(), admission=admission,
                        transport=transport)
    try:
        explorer.join()
        assert explorer.run_continuous(threading.Event(), exit_when_idle_s=0.5) == "idle"
    finally:
        explorer.close("stopped")
    groups = [decode_group(m.value) for m in read_topic(transport, TOPICS.experiences)]
    assert sorted(g.task_id for g in groups) == [t.task_id for t in tasks]
    assert len(read_topic(transport, TOPICS.dead_letter)) == 2 and admission.state().running == 0
