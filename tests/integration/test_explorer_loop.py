"""The explorer's batch loop in this process, with the real broker and a real (HF transformers) engine: partial
admission gives tasks back, bad tasks are dead-lettered with their reason and exploring goes on, a task seen
twice gets a new attempt number, offsets are committed after the groups, weights are picked up from the store and
from control-topic announcements, and the idle clock waits for the consumer group's answer to the join."""
from __future__ import annotations

import threading

import pytest
import torch

from rft.data.tasks import load_rows, rows_to_tasks
from rft.engine import TransformersEngine
from rft.explorer.admission import AdmitAll
from rft.explorer.batch import run_batches
from rft.explorer.main import build_explorer
from rft.rewards import build_reward
from rft.run.config import config_from_dict
from rft.schema import ControlMessage, TaskRecord
from rft.transport import connect
from rft.transport.run_topics import consumer_group
from rft.weights.store import WeightStore, iter_safetensors
from rft.workflows import build_workflow
from tests.integration.explorer_support import Control, Experiences
from tests.waiting import wait_until

pytestmark = [pytest.mark.integration]


class HalfAdmission(AdmitAll):
    """Admits half of what is offered (rounded up) and records every call."""

    def __init__(self):
        self.offered, self.finished, self.failed, self.versions = [], 0, 0, []

    def admit(self, n: int) -> int:
        self.offered.append(n)
        return (n + 1) // 2

    def finish(self, n: int) -> None:
        self.finished += n

    def fail(self, n: int) -> None:
        self.failed += n

    def set_version(self, version: int) -> None:
        self.versions.append(version)


def test_explorer_batches(broker, tiny_model, tmp_path, topic_prefix):
    cfg = config_from_dict({
        "run": {"name": topic_prefix, "mode": "explore"},
        "model": {"path": str(tiny_model), "max_prompt_len": 256, "max_response_len": 4},
        "kafka": {"bootstrap_servers": broker.bootstrap_servers, "partitions": 1, "max_record_bytes": 1500},
        "records": {"claim_threshold_bytes": 0},  # the claim-check off: a group over the limit is refused
        "explorer": {"engine": "transformers", "n_samples": 2, "max_tokens": 1, "tasks_per_batch": 4,
                     "reward": "char_accuracy", "heartbeat_s": 0.5},
        "data": {"path": "copy_char", "format": "generated", "generated_tasks": 5},
        "sync": {"weight_store": str(tmp_path / "store")},
    })
    connect(cfg.kafka, broker.bootstrap_servers).admin().create_topics(
        [cfg.topic(k) for k in ("tasks", "experiences", "control", "dead_letter")])
    toy = rows_to_tasks(load_rows(cfg.data), cfg.data, run_id=cfg.run.name)
    foreign = TaskRecord(run_id="another-run", task_id="x", epoch=0, prompt=":1", answer="1")
    oversized = TaskRecord(run_id=topic_prefix, task_id="big", epoch=0, prompt="7" * 250, answer="7")
    published = toy[:3] + [foreign, toy[0], oversized] + toy[3:]  # toy[0] twice: a re-delivery
    sink = connect(cfg.kafka, broker.bootstrap_servers).sink()

    engine = TransformersEngine(tiny_model)
    admission = HalfAdmission()
    workflow = build_workflow(cfg.explorer, cfg.model, build_reward(cfg.explorer))
    explorer = build_explorer(cfg, explorer_id="loop", engine=engine, workflow=workflow, admission=admission)
    experiences, control = Experiences(cfg, cfg.topic("experiences")), Control(cfg, cfg.topic("control"))
    dead = Experiences(cfg, cfg.topic("dead_letter"))
    try:
        explorer.refresh_weights()
        explorer.join()
        # idle only once the group answered the join: Tansu answers a JoinGroup after 3 s, and until then an explorer
        # cannot tell an empty topic from tasks it will be given (CI once saw an explorer leave with all unexplored)
        assert not explorer.tasks.joined
        assert run_batches(explorer.parts, threading.Event(), exit_when_idle_s=0.0) == "idle"
        assert explorer.tasks.joined and explorer.stats.groups == 0
        for t in published:
            sink.send_record(cfg.topic("tasks"), t, key=t.task_id)
        sink.flush()
        handled = []  # tasks handled per batch

        def all_handled() -> bool:
            handled.append(explorer.run_batch())
            return sum(handled) >= len(published)

        wait_until(all_handled, timeout=60, interval=0, what=f"{len(published)} tasks handled")
        assert sum(handled) == len(published)
        experiences.wait_for(lambda: len(experiences.groups) == 6, timeout_s=20, what="6 groups")
        dead.wait_for(lambda: len(dead.raw) == 2, timeout_s=20, what="2 dead letters")

        # weights: version 1 from the store, then version 2 announced with a path this host cannot read
        store = WeightStore(tmp_path / "store")
        perturbed = {k: v + 0.1 for k, v in iter_safetensors(tiny_model)}
        store.publish(1, [perturbed], tiny_model)
        explorer.refresh_weights()
        assert engine.weights_version == 1
        assert torch.allclose(engine.model.model.embed_tokens.weight, perturbed["model.embed_tokens.weight"])
        store.publish(2, [perturbed], tiny_model)
        (store.root / "LATEST").write_text("1\n")  # as if LATEST had not moved yet: only the announcement tells
        sink.send_record(cfg.topic("control"), ControlMessage("weights", "trainer", {"version": 2, "path": "/nowhere"}))
        sink.flush()
        def loaded_version_2() -> bool:
            explorer.refresh_weights()
            return engine.weights_version == 2

        wait_until(loaded_version_2, timeout=20, interval=0.2, what="the explorer to load version 2")
        assert engine.weights_version == 2  # found in its own store under the announced version
        control.wait_for(lambda: len(control.messages("explorer_heartbeat", "loop")) >= 1, timeout_s=10,
                         what="a heartbeat")
        committed = explorer.tasks.committed(cfg.topic("tasks"))
    finally:
        explorer.close("test over")
        sink.close()
    control.wait_for(lambda: control.messages("explorer_leave", "loop"), timeout_s=10, what="leave")
    for reader in (experiences, control, dead):
        reader.close()

    assert committed == {f"{cfg.topic('tasks')}:0": len(published)}
    groups = experiences.groups
    assert sorted(g.group_id for g in groups) == sorted(t.group_id for t in toy + [toy[0]])
    assert sorted(g.attempt for g in groups if g.group_id == toy[0].group_id) == [0, 1]
    assert all(g.explorer_id == "loop" and g.policy_version == 0 and len(g.samples) == 2 for g in groups)
    reasons = sorted(dict(m.headers)["rft-error"].decode() for m in dead.raw)
    assert reasons[0].startswith("experience group too large: record for topic")
    assert reasons[1] == f"foreign task: run 'another-run', this explorer serves '{topic_prefix}'"
    # admission: asked before every batch, half admitted, the rest re-polled; bad tasks counted as failed
    assert admission.offered[0] == 4 and sum((n + 1) // 2 for n in admission.offered) == len(published)
    assert admission.finished == 6 and admission.failed == 2 and admission.versions == [1, 2]
    assert [m.body["version"] for m in control.messages("explorer_weights", "loop")] == [1, 2]
    assert consumer_group(cfg) == f"{topic_prefix}.explorers"
