"""`rft status`'s view of a run, from a known sequence of control messages (the e2e fault tests read a live run)."""
from __future__ import annotations

from rft.ops.status import RunStatus, explorer_rows, failures_line, mismatch_line, render, signal_line
from rft.schema import ControlMessage
from rft.transport.control import TrainerStep


def msg(kind: str, sender: str, at: float, **body) -> ControlMessage:
    return ControlMessage(kind=kind, sender=sender, body=body, created_at=at)


def test_fleet_states_versions_and_throughput_follow_the_control_topic():
    status = RunStatus(heartbeat_s=1.0)
    for m in [
        msg("trainer_started", "trainer", 100, step=0, version=0, offsets={}),
        msg("explorer_join", "a", 101, explorer_id="a", weights_version=0, host="h1", pid=7, prometheus_port=9401),
        msg("explorer_join", "b", 101, explorer_id="b", weights_version=0, host="h2", pid=8),
        msg("explorer_heartbeat", "a", 110, explorer_id="a", weights_version=0, groups=10, explore_s=5, joined_s=9),
        msg("weights", "trainer", 111, version=1, path="/w/v1", offsets={"x.experiences:0": 8}),
        msg("explorer_weights", "a", 112, explorer_id="a", version=1),
        msg("explorer_heartbeat", "a", 120, explorer_id="a", weights_version=1, groups=30, explore_s=8, joined_s=19),
        msg("explorer_leave", "b", 121, explorer_id="b", reason="stopped", groups=4),
        msg("weights", "trainer", 131, version=3, path="/w/v3", offsets={"x.experiences:0": 24}),
        msg("trainer_waiting", "trainer", 132, version=3, offsets={"x.experiences:0": 24}, groups_in_batch=1),
    ]:
        status.apply(m)
    status.explorers["c"] = status.explorers["a"].__class__("c", last_seen=100.0)  # joined, then nothing
    status.finish(now=122.0)

    assert status.trainer.state == "waiting" and status.trainer.version == 3 and status.trainer.step == 3
    assert status.trainer.offsets == {"x.experiences:0": 24}
    a, b, c = status.explorers["a"], status.explorers["b"], status.explorers["c"]
    assert (a.state, a.weights_version, a.groups, a.host, a.prometheus_port) == ("live", 1, 30, "h1", 9401)
    assert abs(a.busy - 8 / 19) < 1e-12
    assert (b.state, b.left_reason, b.groups) == ("left", "stopped", 4)
    assert c.state == "silent"  # no message for more than 3 heartbeat intervals
    assert abs(status.groups_per_s(now=125.0) - (30 - 10) / (120 - 110)) < 1e-12
    assert abs(status.steps_per_s(now=140.0) - (3 - 0) / (132 - 100)) < 1e-12  # version 0 at 100, 3 at 132

    report = {"run": "x", "mode": "off_policy", "max_staleness": 1, "bootstrap": "k:9092", "max_steps": 10,
              "trainer": {"state": "waiting", "step": 3, "version": 3, "seconds_since_seen": 2.0},
              "weights": {"method": "pull", "push_abandoned": False},
              "explorers": [{"explorer_id": "a", "state": "live", "left_reason": "", "host": "h1", "weights_version": 1,
                             "groups": 30, "batches": 3, "admission_waits": 0, "busy": 0.42, "seconds_since_seen": 2,
                             "partitions": [0, 1]}],
              "experiences": {"produced": 40, "lag": 16}, "tasks": {"published": 100, "lag": 60},
              "throughput": {"groups_per_s": 2.0, "steps_per_s": 0.1, "window_s": 60},
              "fleet": {"live": 1, "idle": 0, "task_partitions": 2, "rejoins": 0, "stalled": None}}
    text = render(report)
    assert "trainer: waiting, step 3/10, weights version 3" in text
    assert "16 not consumed yet" in text and "1 live, 0 silent or left" in text and "v1" in text
    assert "explorers idle: 0 of 1 (2 task partitions)" in text and "STALLED" not in text
    report["fleet"].update(idle=1, stalled="STALLED: 60 tasks pending, no explorer holds a partition for 45 s")
    assert render(report).splitlines()[0] == "STALLED: 60 tasks pending, no explorer holds a partition for 45 s"
    assert "REFUSED" not in text
    assert "(mode off_policy, k=1)" in text
    assert "(mode async, explorers wait at staleness 4)" in render({**report, "mode": "async",
                                                                     "async_max_staleness": 4})
    assert "(mode async, explorers never wait)" in render({**report, "mode": "async", "async_max_staleness": None})
    report["explorers"][0]["weights_refused"] = 2  # forged or damaged announcements: counted by each explorer
    text = render(report)
    assert "REFUSED: 2 weights announcements did not pass the explorers' trust checks" in text
    header, row = text.splitlines()[-2:]
    assert row.split()[header.split().index("refused")] == "2"


def test_the_newest_steps_mismatch_is_printed_from_its_trainer_step_message():
    status = RunStatus(heartbeat_s=1.0)
    status.apply(msg("trainer_step", "trainer", 100, step=7, metrics={
        "logprob_mismatch_mean": 0.0123, "logprob_mismatch_max": 0.51, "logprob_mismatch_kl": 0.00041,
        "logprob_mismatch_frac": 0.002, "logprob_mismatch_stale0_mean": 0.0101, "logprob_mismatch_stale4plus_mean": 0.2,
        "logprob_mismatch_stale1_mean": 0.0164, "reward_mean": 0.4}))
    t = status.trainer
    assert mismatch_line(t.step, t.metrics, 2.0) == (
        "mismatch (step 7): |dlogp| mean 0.0123 max 0.510, KL 0.00041, 0.2% of tokens past ratio 2; by staleness: "
        "0: 0.0101, 1: 0.0164, 4+: 0.2000")
    assert mismatch_line(3, {"reward_mean": 0.1}, 2.0) == "mismatch (step 3): not reported"


def test_the_newest_steps_learning_signal_says_when_the_filter_starves_the_trainer():
    metrics = {"keep_fraction": 0.4, "data_wait_s": 2.0, "step_time_s": 7.5, "entropy": 1.234}
    assert signal_line(12, metrics) == ("learning signal (step 12): 40% of fresh groups kept, waited 2.0 s of a 7.5-s "
                                        "step for experiences, entropy 1.23")
    starved = signal_line(41, {**metrics, "keep_fraction": 0.08, "data_wait_s": 15.6, "step_time_s": 21.5})
    assert starved.startswith("learning signal (step 41): 8% of fresh groups kept, waited 15.6 s of a 21.5-s step")
    assert "STARVED of informative groups" in starved
    assert "STARVED" not in signal_line(41, {**metrics, "keep_fraction": 0.08})  # kept few, but did not wait
    assert signal_line(3, {"reward_mean": 0.1}) is None  # a step that reported none of them: no line
    assert signal_line(3, {"entropy": 0.5}) == "learning signal (step 3): entropy 0.50"  # no filter in the run


def test_failed_rollouts_are_counted_per_class_from_the_heartbeats_and_the_trainers_step():
    status = RunStatus(heartbeat_s=1.0)
    record = {"loss": 0.1, "failed_timeout": 1, "failed_timeout_total": 3, "failed_verifier_total": 1,
              "failed_groups_dropped_total": 1, "skipped": {"too_few_scored": 1}}
    for m in [
        msg("explorer_join", "a", 100, explorer_id="a", weights_version=0),
        msg("explorer_heartbeat", "a", 101, explorer_id="a", groups=3, failed={"timeout": 2, "verifier": 1}),
        msg("explorer_heartbeat", "b", 101, explorer_id="b", groups=3, failed={"timeout": 1}),
        msg("trainer_step", "trainer", 102, step=4, metrics=TrainerStep.step_metrics(record)),
    ]:
        status.apply(m)
    line = failures_line(status.trainer.metrics, explorer_rows(status, now=102.0))
    assert line == ("failed rollouts: explorers timeout 3, verifier 1; trainer timeout 3, verifier 1, 1 groups "
                    "dropped (too few scored)")
    assert failures_line({"loss": 0.1}, []) is None
