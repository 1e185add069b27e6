"""Rewards in worker processes (rft/rewards/limits.py): a verifier that hangs for ever comes back as a `timeout`
failure within the time limit and the next call is served by a new worker; one that raises is `verifier`, one that
returns None `unscored`; a TaskError still dead-letters the task; through the single_turn workflow on the tiny
engine, a group with a hung verifier comes back with that sample failed and its wire record's reward nil."""
from __future__ import annotations

import time

import pytest

from rft.engine import TransformersEngine
from rft.rewards import RewardContext, RewardWorkers, build_reward
from rft.rewards.registry import TaskError
from rft.run.loading import run_config_from_dict
from rft.schema import ExperienceGroup, TaskRecord, decode_group, encode
from rft.workflows import build_workflow

pytestmark = pytest.mark.integration

FLAKY = "tests.reward_plugins:flaky"
LIMIT_S = 1.0


def task(i: int, **metadata) -> TaskRecord:
    return TaskRecord("r", f"t{i}", 0, ":1", "1", metadata)


@pytest.fixture(scope="module")
def workers():
    pool = RewardWorkers(timeout_s=LIMIT_S, workers=1)
    yield pool
    pool.close()


def test_a_hung_verifier_is_a_timeout_in_bounded_time_and_the_next_call_is_served(workers, tmp_path):
    assert workers.call(FLAKY, "warm", task(0)).score == 0.5  # the worker's start is not the call's time
    started = time.monotonic()
    hung = workers.call(FLAKY, "x", task(1, hang_once=str(tmp_path / "hung")))
    elapsed = time.monotonic() - started
    assert hung.failure == "timeout" and LIMIT_S <= elapsed < LIMIT_S + 5
    assert workers.call(FLAKY, "x", task(1, hang_once=str(tmp_path / "hung"))).score == 1.0  # a new worker
    assert workers.failures == {"timeout": 1}


def test_a_raise_is_verifier_none_is_unscored_a_task_error_stays_the_tasks(workers):
    assert workers.call(FLAKY, "x", task(2, **{"raise": True})).failure == "verifier"
    assert workers.call(FLAKY, "x", task(3, none=True)).failure == "unscored"
    assert workers.call(FLAKY, "x", task(4, chatty=True)).score == 0.5  # its print went to stderr, not a frame
    with pytest.raises(TaskError, match="bad_task"):
        workers.call(FLAKY, "x", task(5, bad_task=True))
    assert workers.call(FLAKY, "x", task(6)).score == 0.5


def test_the_workflow_marks_the_hung_sample_and_goes_on(tiny_model, tmp_path):
    cfg = run_config_from_dict({"model": {"path": str(tiny_model), "max_response_len": 8},
                                "explorer": {"engine": "transformers", "reward": FLAKY, "n_samples": 3,
                                             "max_tokens": 4, "reward_timeout_s": LIMIT_S}})
    engine = TransformersEngine(tiny_model, seed=0, weights_version=2)
    context = RewardContext.of(cfg.explorer, cfg.model, seed=0, workers=RewardWorkers.from_config(cfg.explorer))
    assert context.workers is not None
    try:
        workflow = build_workflow(cfg.explorer, cfg.model, build_reward(cfg.explorer, context))
        started = time.monotonic()
        hung, fine = workflow.explore([task(7, hang_once=str(tmp_path / "hung")), task(8)], engine)
        assert time.monotonic() - started < 60
    finally:
        context.workers.close()
    assert hung.error is None and [s.failure for s in hung.samples] == ["timeout", "", ""]
    assert [s.reward for s in hung.samples[1:]] == [1.0, 1.0] and [s.reward for s in fine.samples] == [0.5] * 3
    group = ExperienceGroup(run_id="r", task_id="t7", group_id="g", attempt=0, explorer_id="e", policy_version=2,
                            samples=hung.samples)
    assert [s.failure for s in decode_group(encode(group)[0]).scored_samples] == ["", ""]
