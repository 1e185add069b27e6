"""The typed control protocol (rft/transport/control.py): the wire format stays schema 1 (same kinds, same body keys),
bodies are validated, and ControlView folds messages in the documented order, skipping malformed ones."""
from __future__ import annotations

import dataclasses

import pytest

from rft.schema import ControlMessage, decode, encode
from rft.transport import control
from rft.transport.control import (
    AdmissionClaim,
    AdmissionRelease,
    ControlError,
    ControlView,
    ExplorerHeartbeat,
    ExplorerJoin,
    ExplorerLeave,
    ExplorerWeights,
    PushAbandoned,
    PushGroup,
    TasksGroup,
    TrainerFinished,
    TrainerStarted,
    TrainerStep,
    TrainerWaiting,
    Weights,
    WeightsPush,
    parse,
)

EXAMPLES = [
    Weights(version=3, path="/w/v3", offsets={"r.experiences:0": 24}),
    WeightsPush(group_id="g", version=3, offsets={"r.experiences:0": 24}),
    PushGroup(group_id="g", host="h", port=29500, world_size=3, backend="gloo", timeout_s=30.0),
    PushAbandoned(group_id="g", version=3, reason="timeout"),
    TrainerStarted(step=2, version=2, offsets={}, prometheus_port=None),
    TrainerWaiting(version=2, offsets={"r.experiences:0": 16}, groups_in_batch=1),
    TrainerFinished(step=10),
    TrainerStep(step=4, metrics={"reward_mean": 0.5, "logprob_mismatch_mean": 0.01}),
    ExplorerJoin(explorer_id="e", weights_version=0, host="h", pid=7, prometheus_port=9401),
    ExplorerHeartbeat(explorer_id="e", weights_version=1, groups=4, batches=2, dead_letters=0, admission_waits=1,
                      explore_s=1.5, joined_s=3.0, partitions=[0, 2]),
    ExplorerWeights(explorer_id="e", version=1, seconds=None),
    ExplorerLeave(explorer_id="e", reason="stopped", groups=4),
    TasksGroup(explorer_id="e", group="r.explorers.1", epoch=1, offsets={"r.tasks:0": 7}),
    AdmissionClaim(explorer_id="e", claim_id="e/1/0", groups=3, limit=8, seen=12, version=2),
    AdmissionRelease(explorer_id="e", groups=2),
]

# the body keys each kind had before the protocol was typed (docs/schema.md: schema 1), plus optional fields added
# since (an older reader ignores them): explorer_heartbeat's weights_refused, weights' and push_group's lineage
WIRE_KEYS = {
    "weights": {"version", "path", "offsets", "lineage"},
    "weights_push": {"group_id", "version", "offsets"},
    "push_group": {"group_id", "host", "port", "world_size", "backend", "timeout_s", "lineage"},
    "push_abandoned": {"group_id", "version", "reason"},
    "trainer_started": {"step", "version", "offsets", "prometheus_port"},
    "trainer_waiting": {"version", "offsets", "groups_in_batch"},
    "trainer_finished": {"step"},
    "explorer_join": {"explorer_id", "weights_version", "host", "pid", "prometheus_port"},
    "explorer_heartbeat": {"explorer_id", "weights_version", "groups", "batches", "dead_letters", "admission_waits",
                           "weights_refused", "explore_s", "joined_s", "partitions"},
    "explorer_weights": {"explorer_id", "version", "seconds"},
    "explorer_leave": {"explorer_id", "reason", "groups"},
    "tasks_group": {"explorer_id", "group", "epoch", "offsets"},  # added with the membership watchdog
    "trainer_step": {"step", "metrics"},  # added with the training-inference mismatch (issue 28)
    "admission_claim": {"explorer_id", "claim_id", "groups", "limit", "seen", "version"},  # the ledger (issue 28)
    "admission_release": {"explorer_id", "groups", "reset", "by"},
}
# optional keys added since, each with a default: a message without them (an older sender) still parses
ADDED_KEYS = {"explorer_heartbeat": {"unassigned_s", "rejoins", "failed"}}  # failed: issue 57


@pytest.mark.parametrize("kind", EXAMPLES, ids=lambda k: k.KIND)
def test_every_kind_round_trips_through_the_unchanged_wire_format(kind):
    message = kind.to_message(created_at=100.0)
    added = ADDED_KEYS.get(kind.KIND, set())
    assert set(message.body) == WIRE_KEYS[kind.KIND] | added
    older = {k: v for k, v in message.body.items() if k not in added}
    defaults = {f.name: f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
                for f in dataclasses.fields(kind) if f.name in added}
    assert type(kind).from_body(older) == dataclasses.replace(kind, **defaults)
    assert message.sender == (kind.explorer_id if hasattr(kind, "explorer_id") else "trainer")
    decoded = decode(*encode(message))
    assert isinstance(decoded, ControlMessage) and decoded.kind == kind.KIND
    assert parse(decoded) == kind
    assert set(control.KINDS) == set(WIRE_KEYS)


def test_malformed_bodies_are_refused_with_the_kind_and_field():
    with pytest.raises(ControlError, match="weights: missing field 'version'"):
        Weights.from_body({"path": "/w"})
    with pytest.raises(ControlError, match="weights: field 'version' must be int, got '3'"):
        Weights.from_body({"version": "3"})
    with pytest.raises(ControlError, match=r"trainer_waiting: field \"offsets\['p:0'\]\" must be int"):
        TrainerWaiting.from_body({"version": 1, "offsets": {"p:0": "x"}})
    with pytest.raises(ControlError, match="expected a weights message"):
        Weights.from_message(ControlMessage("trainer_finished", "trainer", {}))
    # optional fields may be missing; an explorer's id defaults to the sender; unknown keys are ignored
    assert Weights.from_body({"version": 1, "extra": True}) == Weights(version=1)
    assert ExplorerLeave.from_message(ControlMessage("explorer_leave", "e9", {})).explorer_id == "e9"
    assert parse(ControlMessage("from_the_future", "x", {"a": 1})) is None


def test_the_view_skips_and_counts_malformed_messages():
    view = ControlView()
    view.apply(ControlMessage("weights", "trainer", {"version": "two"}, created_at=1))
    view.apply(ControlMessage("explorer_heartbeat", "e", {"groups": [1]}, created_at=1))
    view.apply(ControlMessage("unknown_kind", "trainer", {}, created_at=1))
    assert view.malformed == 2 and view.trainer.version == 0 and not view.explorers


def test_trainer_state_follows_the_newest_trainer_message_whatever_the_read_order():
    view = ControlView()
    view.apply(Weights(version=2, path="/w/v2", offsets={"x:0": 8}).to_message(created_at=20))
    view.apply(Weights(version=1, path="/w/v1", offsets={"x:0": 4}).to_message(created_at=10))  # older, read later
    assert (view.trainer.version, view.trainer.offsets, view.trainer.state) == (2, {"x:0": 8}, "training")
    view.apply(TrainerFinished(step=2).to_message(created_at=30))
    assert view.trainer_finished and view.trainer.step == 2
    assert view.announced.version == 2  # the newest version announced with a path


def test_explorers_live_until_they_leave_or_fall_silent():
    view = ControlView()
    view.apply(ExplorerJoin(explorer_id="a").to_message(created_at=1), received_at=100)
    view.apply(ExplorerJoin(explorer_id="b").to_message(created_at=1), received_at=100)
    view.apply(ExplorerHeartbeat(explorer_id="c", groups=1).to_message(created_at=1), received_at=90)
    assert view.live_explorers(now=101, horizon_s=15) == 3  # heard 1, 1 and 11 s ago (this process's clock)
    view.apply(ExplorerLeave(explorer_id="b", reason="stopped").to_message(created_at=2), received_at=101)
    assert view.live_explorers(now=102, horizon_s=15) == 2  # a and c
    assert view.live_explorers(now=110, horizon_s=15) == 1  # c: 20 s ago
    assert view.explorers["b"].state == "left" and view.explorers["b"].left_reason == "stopped"


def test_push_groups_pushed_versions_and_abandonment():
    view = ControlView()
    view.apply(PushGroup(group_id="g1", host="h", port=1, world_size=2, backend="gloo", timeout_s=1).to_message())
    view.apply(WeightsPush(group_id="g1", version=1).to_message())
    view.apply(WeightsPush(group_id="g1", version=2).to_message())
    assert view.pushed == {"g1": [1, 2]} and not view.push_abandoned
    view.apply(PushAbandoned(group_id="g1", version=3).to_message())
    assert view.abandoned == {"g1"} and view.push_abandoned
    view.apply(PushGroup(group_id="g2", host="h", port=2, world_size=2, backend="gloo", timeout_s=1).to_message())
    assert view.push_group.group_id == "g2" and not view.push_abandoned


def test_trainer_step_carries_the_step_metrics_rft_status_prints():
    record = {"step": 4, "loss": 0.1, "reward_mean": 0.5, "staleness_max": 1, "skipped": {"stale": 2},
              "logprob_mismatch_mean": 0.01, "logprob_mismatch_stale1_kl": 0.002, "grad_norm": 3.0, "flag": True,
              "keep_fraction": 0.25, "data_wait_s": 3.5, "step_time_s": 8.0, "entropy": 0.7, "train_s": 4.5}
    assert TrainerStep.step_metrics(record) == {"loss": 0.1, "reward_mean": 0.5, "staleness_max": 1.0,
                                                "logprob_mismatch_mean": 0.01, "logprob_mismatch_stale1_kl": 0.002,
                                                "keep_fraction": 0.25, "data_wait_s": 3.5, "step_time_s": 8.0,
                                                "entropy": 0.7}
    view = ControlView()
    view.apply(TrainerWaiting(version=3).to_message(created_at=10.0))
    view.apply(TrainerStep(step=4, metrics={"logprob_mismatch_mean": 0.01}).to_message(created_at=11.0))
    assert (view.trainer.state, view.trainer.step, view.trainer.version) == ("training", 4, 3)
    assert view.trainer.metrics == {"logprob_mismatch_mean": 0.01}


def test_admission_messages_leave_the_fleet_view_alone():
    """Claims and releases are the admission ledger's: they neither overwrite an explorer's counters nor make a
    silent explorer live again (a release on its behalf comes from another explorer)."""
    view = ControlView()
    view.apply(ExplorerJoin(explorer_id="e").to_message(created_at=1.0), received_at=1.0)
    view.apply(ExplorerHeartbeat(explorer_id="e", groups=7).to_message(created_at=2.0), received_at=2.0)
    view.apply(AdmissionClaim(explorer_id="e", claim_id="c", groups=3, limit=4, seen=0).to_message(), received_at=50.0)
    view.apply(AdmissionRelease(explorer_id="e", reset=True, by="f").to_message(), received_at=50.0)
    assert view.explorers["e"].groups == 7 and view.heard["e"] == 2.0
    assert AdmissionRelease(explorer_id="e", reset=True, by="f").to_message().sender == "f"


def test_the_trainers_partial_step_is_in_the_view_until_the_step_ends():
    """`trainer_waiting` says how many groups the trainer took into the step it waits to complete (admission counts
    them as taken); a `weights` announcement is at a step's end: none."""
    view = ControlView()
    view.apply(TrainerWaiting(version=2, offsets={"r.experiences:0": 10}, groups_in_batch=2).to_message(created_at=1.0))
    assert (view.trainer.version, view.trainer.groups_in_batch) == (2, 2)
    view.apply(Weights(version=3, path="/w", offsets={"r.experiences:0": 12}).to_message(created_at=2.0))
    assert (view.trainer.version, view.trainer.groups_in_batch, view.trainer.offsets) == (3, 0, {"r.experiences:0": 12})
