"""The explorer's batch loop (rft/explorer/batch.py) over the in-memory transport, no broker and no inference
engine.

Stand-ins, both allowed by the test rules: the transport is `rft.transport.memory` (an in-memory implementation of
our own RecordSink/RecordSource protocols), and the engine and workflow are in-memory implementations of our own
Engine and Workflow protocols: the workflow answers each task with one sample and stamps the version the engine
holds, the engine records the versions it was asked to load. The weight store is the real one, on disk.

Contracts checked: the newest version in the store is loaded before the explorer joins the tasks consumer group
(a late joiner generates nothing with old weights), and a newer version is loaded between batches, never inside
one; tasks admission holds back are given back and explored later, so every task gives exactly one group; a
malformed task, a foreign run's task, a task over the run's image limits and a task the workflow cannot explore are
dead-lettered with their reasons;
the batch's task offsets are committed after its groups are acknowledged; join comes before any group, leave last.
"""
from __future__ import annotations

import threading

import numpy as np
import torch

from rft.explorer.admission import AdmitAll
from rft.explorer.config import ExplorerConfig
from rft.explorer.explorer import Explorer
from rft.schema import HEADER_ERROR, ImageLimits, Sample, TaskRecord, decode_group
from rft.transport.config import KafkaConfig
from rft.transport.control import ExplorerJoin, ExplorerLeave, ExplorerWeights, control_messages, parse
from rft.transport.memory import MemoryTransport
from rft.transport.run_topics import RunTopics, create_run_topics
from rft.weights.config import SyncConfig
from rft.weights.store import WeightStore
from rft.workflows import GroupResult
from tests.records import make_image, read_topic

TOPICS = RunTopics(run="run", tasks="run.tasks", experiences="run.experiences", control="run.control",
                   dead_letter="run.dead_letter", explorers_group="run.explorers")


class StandInEngine:
    """Engine protocol, in memory: holds a weights version; `load_weights` records what it loaded."""

    def __init__(self):
        self.weights_version = 0
        self.loaded: list[int] = []

    def load_weights(self, path, version: int) -> None:
        assert (path / "LATEST").exists() is False  # a version directory, not the store root
        self.weights_version = version
        self.loaded.append(version)


class StandInWorkflow:
    """Workflow protocol, in memory: one sample per task, stamped with the engine's version; a task whose prompt is
    "cannot" is an error; one whose prompt is "verifier hangs" has its sample failed (a timeout). `on_batch` runs
    after each batch (the test publishes a new version there)."""

    def __init__(self, on_batch=None):
        self.batches: list[list[str]] = []
        self.on_batch = on_batch or (lambda: None)

    def explore(self, tasks, engine):
        self.batches.append([t.task_id for t in tasks])
        results = []
        for t in tasks:
            if t.prompt == "cannot":
                results.append(GroupResult(task=t, error="the prompt is too long"))
                continue
            sample = Sample(sample_index=0, prompt_tokens=np.array([1, 2], dtype=np.int32),
                            response_tokens=np.array([3], dtype=np.int32), logprobs=np.array([-0.5], np.float32),
                            loss_mask=np.array([1], dtype=np.uint8), reward=1.0,
                            failure="timeout" if t.prompt == "verifier hangs" else "")
            results.append(GroupResult(task=t, samples=[sample], policy_version=engine.weights_version))
        self.on_batch()
        return results


class HalfAdmission(AdmitAll):
    """Admits half of what is offered (rounded up)."""

    def __init__(self):
        self.offered: list[int] = []

    def admit(self, n: int) -> int:
        self.offered.append(n)
        return (n + 1) // 2


def publish(store: WeightStore, version: int) -> None:
    store.publish(version, [{"w": torch.full((2,), float(version))}], hf_dir=None)


def test_explorer_loop_contracts(tmp_path):
    transport = MemoryTransport(partitions=2)
    kafka = KafkaConfig(bootstrap_servers="memory", partitions=2)
    create_run_topics(TOPICS, kafka, transport)
    store = WeightStore(tmp_path / "store")
    publish(store, 2)  # the run is at version 2 when this explorer starts

    good = [TaskRecord(run_id="run", task_id=f"t{i}", epoch=0, prompt="verifier hangs" if i == 8 else f"p{i}")
            for i in range(9)]
    sink = transport.sink()
    pictured = TaskRecord(run_id="run", task_id="i", epoch=0, prompt="p", images=[make_image(), make_image(seed=1)])
    for t in good[:4] + [TaskRecord(run_id="other", task_id="x", epoch=0, prompt="p"),
                         TaskRecord(run_id="run", task_id="c", epoch=0, prompt="cannot"), pictured] + good[4:]:
        sink.send_record(TOPICS.tasks, t, key=t.task_id)
    sink.send(TOPICS.tasks, b"\x93not a task", headers=[("rft-schema", b"1"), ("rft-type", b"task")])

    engine, admission = StandInEngine(), HalfAdmission()
    workflow = StandInWorkflow(on_batch=lambda: publish(store, 3) if len(workflow.batches) == 2 else None)
    explorer = Explorer(ExplorerConfig(tasks_per_batch=4, heartbeat_s=60), kafka=kafka, sync=SyncConfig(),
                        topics=TOPICS, store=store, explorer_id="e1", engine=engine, workflow=workflow,
                        admission=admission, transport=transport, images=ImageLimits(max_images=1, origin="data"))
    stop = threading.Event()
    try:
        explorer.refresh_weights()
        assert engine.loaded == [2]  # before joining
        explorer.join()
        handled = 0
        for _ in range(60):
            explorer.refresh_weights()
            handled += explorer.run_batch()
            if handled == 13:
                break
        assert handled == 13
    finally:
        stop.set()
        explorer.close("stopped")

    groups = [decode_group(m.value) for m in read_topic(transport, TOPICS.experiences)]
    assert sorted(g.task_id for g in groups) == sorted(t.task_id for t in good)  # each task once
    assert all(g.attempt == 0 and g.explorer_id == "e1" for g in groups)
    # a failed rollout is delivered in its group (reward nil on the wire) and counted per class, not dead-lettered
    assert [s.failure for g in groups if g.task_id == "t8" for s in g.samples] == ["timeout"]
    assert explorer.stats.failed == {"timeout": 1}
    # batch 1 and 2 ran with version 2; version 3 appeared during batch 2 and was loaded before batch 3
    versions = [g.policy_version for g in groups]
    assert engine.loaded == [2, 3] and versions == sorted(versions) and set(versions) == {2, 3}
    assert any(n > 1 for n in admission.offered)  # some tasks were given back and explored later

    dead = read_topic(transport, TOPICS.dead_letter)
    reasons = sorted(dict(m.headers)[HEADER_ERROR].decode().split(":")[0] for m in dead)
    assert len(dead) == 4 and any("foreign task" in r for r in reasons) \
        and any("cannot be explored" in r for r in reasons), reasons
    assert any(dict(m.headers)[HEADER_ERROR] == b"images: 2 images, over data.max_images = 1" for m in dead)

    source = transport.source(group=TOPICS.explorers_group, topics=[TOPICS.tasks])
    committed = source.committed(TOPICS.tasks)
    ends = source.end_offsets(TOPICS.tasks)
    assert committed == ends  # every task's offset committed, after its group was acknowledged

    # the control topic has two partitions: put its messages back in the order they were sent
    messages = sorted(control_messages(read_topic(transport, TOPICS.control)), key=lambda m: m.created_at)
    kinds = [parse(m) for m in messages]
    names = [type(k).__name__ for k in kinds]
    assert names[0] == "ExplorerWeights" and kinds[0].version == 2  # loaded before joining
    assert names[1] == "ExplorerJoin" and isinstance(kinds[-1], ExplorerLeave) and kinds[-1].groups == 9
    assert [k.version for k in kinds if isinstance(k, ExplorerWeights)] == [2, 3]
    assert sum(isinstance(k, ExplorerJoin) for k in kinds) == 1
