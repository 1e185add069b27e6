"""`rft bench modes` arithmetic on hand-made inputs: the stage-alone generation rate, the bounds, and the per-version
weight-sync split (publish, notice, reload) read from control messages. The whole benchmark runs in
tests/e2e/test_bench_modes_run.py."""
from __future__ import annotations

import pytest

from benchmarks.modes import bounds, generation_rate, weight_sync
from rft.transport.control import ExplorerHeartbeat, ExplorerWeights, Weights


def test_generation_rate_counts_what_came_after_the_first_batch():
    # two explorer batches of 2 groups (8 samples, 20 tokens each) 3 s apart, after a start-up batch at t=10 s
    groups = [(16_000, 8, 20), (10_000, 8, 20), (13_000, 8, 20), (10_010, 8, 20), (13_020, 8, 20), (16_010, 8, 20)]
    rate = generation_rate(groups, first_batch=2)
    span = 16.010 - 10.010
    assert rate["span_s"] == pytest.approx(span)
    assert rate["samples_per_s"] == pytest.approx(4 * 8 / span)
    assert rate["tokens_per_s"] == pytest.approx(4 * 20 / span)
    assert rate["groups"] == 6


def test_generation_rate_needs_more_than_the_first_batch():
    with pytest.raises(RuntimeError, match="published 2 groups, need more than the first batch"):
        generation_rate([(1, 8, 8), (2, 8, 8)], first_batch=2)


def test_bounds_take_turns_in_sync_and_overlap_otherwise():
    b = bounds(gen=6.0, train=3.0)
    assert b["sync"] == pytest.approx(2.0)  # 1 / (1/6 + 1/3): a sample costs 1/6 s + 1/3 s
    assert b["overlapped"] == 3.0


def test_weight_sync_splits_each_version_into_publish_notice_and_reload():
    steps = [{"step": 1, "weights_s": 0.2, "weights_write_s": 0.5}, {"step": 2, "weights_s": 0.4,
                                                                       "weights_write_s": 0.3}]
    control = [
        (100.0, Weights(version=1, path="/store/v1")),
        (100.9, ExplorerWeights(explorer_id="a", version=1, seconds=0.5)),  # started at 100.4: noticed after 0.4 s
        (101.5, ExplorerWeights(explorer_id="b", version=1, seconds=1.5)),  # started at 100.0: the first to notice
        (110.0, Weights(version=2, path="/store/v2")),
        (110.1, ExplorerHeartbeat(explorer_id="a", groups=3)),
        (110.8, ExplorerWeights(explorer_id="a", version=2, seconds=0.6)),  # started at 110.2
        (111.0, ExplorerWeights(explorer_id="b", version=2, seconds=None)),  # pushed: no reload seconds
        (120.0, Weights(version=3, path="/store/v3")),  # loaded by nobody before the run ended: not counted
    ]
    sync = weight_sync(steps, control)
    assert sync["versions"] == 2
    assert sync["publish_s"] == pytest.approx((0.7 + 0.7) / 2)
    assert sync["copy_s"] == pytest.approx((0.2 + 0.4) / 2)  # of publish: on the trainer's critical path
    assert sync["notice_s"] == pytest.approx((0.0 + 0.2) / 2)
    assert sync["reload_s"] == pytest.approx((1.5 + 0.6) / 2)
    assert sync["weight_sync_s"] == pytest.approx(sync["publish_s"] + sync["notice_s"] + sync["reload_s"])


def test_weight_sync_without_reloads_reports_none():
    sync = weight_sync([{"step": 1, "weights_s": 0.1}], [(1.0, Weights(version=1))])
    assert sync["weight_sync_s"] is None and sync["versions"] == 0


def test_simulator_stages_come_from_the_measurements(tmp_path, monkeypatch):
    import argparse

    import benchmarks.modes
    from benchmarks.modes import simulator_stages
    monkeypatch.setattr(benchmarks.modes.os, "cpu_count", lambda: 2)  # this machine's shape, wherever it runs
    (tmp_path / "model.safetensors").write_bytes(b"\0" * 2_000_000)
    args = argparse.Namespace(samples=8, groups=4, tasks_per_batch=4, explorers=2, threads=1)
    stages = {"generation": {"samples_per_s": 4.0}, "training": {"samples_per_s": 2.0}}
    sync_row = {"copy_s": 1.0, "notice_s": 0.3, "reload_s": 1.2}
    s = simulator_stages(args, stages, sync_row, str(tmp_path))
    assert s.gen_group_s == 2 * 8 / 4.0 and s.cores == 2.0  # the fleet's rate shared by 2 explorers, a core each
    three = simulator_stages(argparse.Namespace(**{**vars(args), "explorers": 3}), stages, sync_row, str(tmp_path))
    assert three.gen_group_s == 3 * 8 / 4.0 * 2 / 3  # 3 explorers shared 2 cores: each alone is 3/2 as fast
    assert simulator_stages(argparse.Namespace(**{**vars(args), "threads": 2}), stages, sync_row,
                            str(tmp_path)).cores == 1.0
    assert s.train_s == 4 * 8 / 2.0 - 1.0 and s.publish_s == 1.0  # the step as measured alone, publish apart
    assert (s.notice_s, s.reload_s, s.weights_gb) == (0.3, 1.2, 0.002)
    assert (s.tasks_per_batch, s.samples_per_group, s.groups_per_step) == (4, 8, 4)
