"""rft.dashboard.model: metrics.jsonl and control messages folded into the page's snapshot (on rft's in-memory
transport), malformed records skipped and counted, and the states the page reports: not found, not started,
broker unreachable, embedded broker not running, finished."""
from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import pytest

from rft.dashboard.model import MetricsTail, RunIndex, RunWatch
from rft.run.config import Config, config_from_dict
from rft.schema import ControlMessage
from rft.transport import TransportError
from rft.transport.control import (
    ExplorerHeartbeat,
    ExplorerJoin,
    ExplorerLeave,
    ExplorerWeights,
    TrainerFinished,
    Weights,
)
from rft.transport.memory import MemoryTransport

T0 = 1_700_000_000.0


def run_config(tmp_path: Path, name: str = "r", bootstrap: str = "memory:0") -> Config:
    return config_from_dict({"run": {"name": name, "output_dir": str(tmp_path / "runs")},
                             "model": {"path": str(tmp_path / "model")}, "kafka": {"bootstrap_servers": bootstrap},
                             "explorer": {"heartbeat_s": 1.0}})


def write_run(cfg: Config, metrics_lines: list[str] = ()) -> Path:
    cfg.run_dir.mkdir(parents=True, exist_ok=True)
    (cfg.run_dir / "config.yaml").write_text(cfg.to_yaml())
    if metrics_lines:
        (cfg.run_dir / "metrics.jsonl").write_text("".join(line + "\n" for line in metrics_lines))
    return cfg.run_dir


def step_line(step: int, **values) -> str:
    return json.dumps({"time": T0 + step, "step": step, "reward_mean": step / 10, **values})


def test_metrics_tail_skips_and_counts_bad_lines_waits_for_partial_ones_and_restarts_on_a_new_file(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("\n".join([step_line(1), "{not json", "[1, 2]", json.dumps({"step": 2}),
                               json.dumps({"time": T0, "step": "3"}), json.dumps({"time": T0, "loss": float("nan")}),
                               step_line(2, staleness_hist={"0": 4, "1": "x"}, skipped={})]) + "\n" + step_line(3)[:20])
    tail = MetricsTail(path)
    tail.read()
    assert [r.get("step") for r in tail.records] == [1, None, 2]
    assert tail.malformed == 4  # bad JSON, not a map, no time, a step that is no int
    assert "loss" not in tail.records[1]  # NaN dropped, not passed on
    assert tail.records[2]["staleness_hist"] == {"0": 4}
    with open(path, "a") as f:  # the half-written line completes
        f.write(step_line(3)[20:] + "\n")
    tail.read()
    assert [r.get("step") for r in tail.records][-1] == 3 and tail.epoch == 0
    path.unlink()
    path.write_text(step_line(1) + "\n")  # a new run of the same name
    tail.read()
    assert [r["step"] for r in tail.records] == [1] and tail.epoch == 1 and tail.malformed == 0


def send_control(transport: MemoryTransport, cfg: Config, messages: list[ControlMessage]) -> None:
    sink = transport.sink()
    for message in messages:
        sink.send_record(cfg.topic("control"), message)
    sink.flush()


def test_snapshot_folds_the_control_topic_and_metrics_counting_what_it_skips(tmp_path):
    cfg = run_config(tmp_path)
    write_run(cfg, [step_line(1), step_line(2), "garbage"])
    transport = MemoryTransport()
    transport.admin().create_topics([cfg.topic("control"), cfg.topic("tasks"), cfg.topic("experiences")], 2)
    send_control(transport, cfg, [
        ExplorerJoin("e0", weights_version=0, host="h", pid=11).to_message(created_at=T0),
        ExplorerJoin("e1", weights_version=0, host="h", pid=12).to_message(created_at=T0 + 0.5),
        Weights(version=2, path="/w/2").to_message(created_at=T0 + 2),
        ExplorerWeights("e0", version=2, seconds=0.1).to_message(created_at=T0 + 3),
        ExplorerHeartbeat("e0", weights_version=2, groups=5, batches=2, explore_s=1.0, joined_s=4.0)
        .to_message(created_at=T0 + 4),
        ExplorerLeave("e1", reason="stopped", groups=1).to_message(created_at=T0 + 5),
        ControlMessage(kind="explorer_heartbeat", sender="e0", body={"groups": "many"}, created_at=T0 + 6),
    ])
    transport.sink().send(cfg.topic("control"), b"\x00not a record")
    watch = RunWatch("r", cfg.run_dir, transport_for=lambda c: transport)
    for _ in range(3):
        watch.refresh(poll_s=0.05)

    snap = watch.snapshot(now=T0 + 5)
    assert snap["state"] == "running" and snap["broker"]["state"] == "connected" and snap["notices"] == []
    assert [r["step"] for r in snap["records"]] == [1, 2] and snap["records_total"] == 2
    assert snap["skipped"] == {"metrics_lines": 1, "control_undecodable": 1, "control_malformed": 1}
    fleet = {e["explorer_id"]: e for e in snap["explorers"]}
    assert fleet["e0"]["state"] == "live" and fleet["e0"]["weights_version"] == 2 and fleet["e0"]["groups"] == 5
    assert fleet["e0"]["busy"] == pytest.approx(0.25)
    assert fleet["e1"]["state"] == "left" and fleet["e1"]["left_reason"] == "stopped"
    assert [(e["kind"], e["who"]) for e in snap["fleet_events"]] == [("join", "e0"), ("join", "e1"), ("leave", "e1")]
    assert snap["trainer"]["version"] == 2 and snap["config"]["mode"] == cfg.run.mode
    assert snap["config"]["async_max_staleness"] == cfg.run.async_max_staleness == 4  # the page's async label
    assert {"experiences", "tasks"} <= set(snap["lags"])

    # three heartbeats without a message: silent; a stream gets only the records it has not had yet
    later = watch.snapshot(since=2, epoch=0, now=T0 + 4 + 3.5)
    assert {e["explorer_id"]: e["state"] for e in later["explorers"]} == {"e0": "silent", "e1": "left"}
    assert later["records"] == [] and later["records_offset"] == 2

    send_control(transport, cfg, [TrainerFinished(step=2).to_message(created_at=T0 + 7)])
    watch.refresh(poll_s=0.05)
    assert watch.snapshot()["state"] == "finished"
    watch.stop()


def test_a_run_that_has_not_started_then_an_unreachable_broker_then_embedded(tmp_path):
    cfg = run_config(tmp_path)
    write_run(cfg)
    transport = MemoryTransport()
    watch = RunWatch("r", cfg.run_dir, transport_for=lambda c: transport)
    watch.refresh(poll_s=0.01)
    snap = watch.snapshot()
    assert snap["state"] == "not-started" and snap["broker"]["state"] == "no-topic"
    assert any("has not started yet" in n for n in snap["notices"])

    def unreachable(c: Config):
        raise TransportError(f"no Kafka broker reachable at {c.kafka.bootstrap_servers}")

    write_run(cfg, [step_line(1)])
    gone = RunWatch("r", cfg.run_dir, transport_for=unreachable)
    gone.refresh(poll_s=0.01)
    snap = gone.snapshot()
    assert snap["state"] == "ended" and snap["broker"]["state"] == "unreachable"
    assert "no Kafka broker reachable at memory:0" in snap["broker"]["error"]
    assert any("unreachable" in n and "metrics.jsonl only" in n for n in snap["notices"])
    assert [r["step"] for r in snap["records"]] == [1]  # the curves still come from metrics.jsonl

    embedded = run_config(tmp_path, "e", bootstrap="embedded")
    watch = RunWatch("e", embedded.run_dir, fallback=embedded)  # `rft run` has not written its config.yaml yet
    watch.refresh(poll_s=0.01)
    snap = watch.snapshot()
    assert snap["broker"]["state"] == "embedded" and snap["state"] == "not-started"
    assert any("exists only while `rft run` runs" in n for n in snap["notices"])


def test_the_run_index_lists_runs_beside_the_configs_and_finds_no_unknown_one(tmp_path):
    cfg = run_config(tmp_path, "main")
    other = run_config(tmp_path, "other")
    write_run(other, [step_line(1)])
    staged = other.run_dir / "stages" / "other.sft"
    staged.mkdir(parents=True)
    (staged / "metrics.jsonl").write_text(step_line(1) + "\n")
    (tmp_path / "runs" / "not-a-run").mkdir()
    index = RunIndex(cfg, transport_for=lambda c: MemoryTransport())
    try:
        assert [r["name"] for r in index.runs()] == ["main", "other", "other.sft"]
        assert index.runs()[0]["default"] and not index.runs()[0]["has_metrics"]
        assert index.get("nope") is None and index.get("not-a-run") is None
        assert index.get("other").snapshot()["run"] == "other"
    finally:
        index.close()


def test_a_run_that_ends_and_is_restarted_on_a_new_broker_is_followed_there(tmp_path):
    """`rft run` again after a run ended: it starts a new embedded broker, rewrites config.yaml with its address and
    appends to metrics.jsonl. The watch moves to the new broker and keeps the curves (each broker is one of rft's
    in-memory transports here, chosen by the bootstrap address the config names)."""

    brokers = {"memory:first": MemoryTransport(), "memory:second": MemoryTransport()}
    cfg = run_config(tmp_path, bootstrap="memory:first")
    write_run(cfg, [step_line(1), step_line(2)])
    for transport in brokers.values():
        transport.admin().create_topics([cfg.topic("control"), cfg.topic("tasks"), cfg.topic("experiences")], 2)
    send_control(brokers["memory:first"], cfg, [
        ExplorerJoin("e0", weights_version=0, host="h", pid=11).to_message(created_at=T0),
        TrainerFinished(step=2).to_message(created_at=T0 + 3)])
    watch = RunWatch("r", cfg.run_dir, transport_for=lambda c: brokers[c.kafka.bootstrap_servers])
    watch.refresh(poll_s=0.05)
    assert watch.snapshot()["state"] == "finished"

    restarted = run_config(tmp_path, bootstrap="memory:second")
    write_run(restarted)
    config_file = restarted.run_dir / "config.yaml"
    os.utime(config_file, (T0 + 10, T0 + 10))  # a new modification time, whatever the clock's resolution
    with open(restarted.run_dir / "metrics.jsonl", "a") as f:
        f.write(step_line(3) + "\n")
    send_control(brokers["memory:second"], restarted, [
        ExplorerJoin("e1", weights_version=2, host="h", pid=21).to_message(created_at=T0 + 11)])
    for _ in range(2):
        watch.refresh(poll_s=0.05)
    snap = watch.snapshot(now=T0 + 11.5)
    assert snap["broker"] == {"state": "connected", "bootstrap": "memory:second", "error": ""}
    assert snap["state"] == "running"
    assert [r["step"] for r in snap["records"]] == [1, 2, 3]
    assert [e["explorer_id"] for e in snap["explorers"]] == ["e1"]  # the new run's fleet, not the old one's


def test_a_stream_of_snapshots_skips_no_record_while_the_file_grows(tmp_path):
    """The page's stream asks for the records since the total it was last sent while the refresh thread reads new
    lines: records, total and epoch must be of one moment (a step appended between the two was once lost for good,
    seen in the browser test as a missing point)."""
    cfg = run_config(tmp_path)
    path = write_run(cfg) / "metrics.jsonl"
    transport = MemoryTransport()
    watch = RunWatch("r", cfg.run_dir, transport_for=lambda c: transport)
    steps = 1000
    done = threading.Event()

    def grow():
        with open(path, "a") as f:
            for step in range(1, steps + 1):
                f.write(step_line(step) + "\n")
                f.flush()
                watch.metrics.read()  # what RunWatch's refresh thread does
        done.set()

    writer = threading.Thread(target=grow)
    writer.start()
    seen, sent, epoch = [], 0, None
    while writer.is_alive() or (done.is_set() and sent < steps):
        snap = watch.snapshot(since=sent, epoch=epoch)  # what the server's event stream does
        seen += [r["step"] for r in snap["records"]]
        sent, epoch = snap["records_total"], snap["records_epoch"]
    writer.join()
    assert seen == list(range(1, steps + 1))
