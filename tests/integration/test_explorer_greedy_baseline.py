"""The greedy baseline of algorithm remax, through an explorer: a config with `algorithm.name: remax` (loaded as a run
loads it, which turns explorer.greedy_baseline on) composes an explorer whose groups, produced to a real broker, each
carry `greedy_reward`: the reward of the task's greedy completion, checked against an independent greedy decode of
the tiny model (transformers engine, in this process); the greedy completion is not one of the group's samples."""
from __future__ import annotations

import pytest

from rft.engine import TransformersEngine
from rft.explorer.main import compose_explorer
from rft.rewards import resolve
from rft.run.loading import run_config_from_dict
from rft.schema import TaskRecord
from tests.integration.explorer_support import Experiences, publish_numbered_tasks
from tests.unit.test_algorithms_remax import greedy_decode
from tests.waiting import wait_until

pytestmark = [pytest.mark.integration]


def test_an_explorer_of_a_remax_run_records_each_tasks_greedy_reward(broker, tiny_model, tmp_path, topic_prefix):
    cfg = run_config_from_dict({
        "run": {"name": topic_prefix, "mode": "explore"},
        "model": {"path": str(tiny_model), "max_prompt_len": 64, "max_response_len": 4},
        "kafka": {"bootstrap_servers": broker.bootstrap_servers, "partitions": 1},
        "algorithm": {"name": "remax"},
        "explorer": {"engine": "transformers", "n_samples": 2, "max_tokens": 4, "tasks_per_batch": 4,
                     "reward": "char_accuracy", "heartbeat_s": 0.5},
        "data": {"path": "copy_char", "format": "generated", "generated_tasks": 4},
        "sync": {"weight_store": str(tmp_path / "store")},
    })
    assert cfg.explorer.greedy_baseline
    tasks = publish_numbered_tasks(cfg)
    engine = TransformersEngine(tiny_model)
    explorer = compose_explorer(cfg, explorer_id="remax", engine=engine)
    experiences = Experiences(cfg, cfg.topic("experiences"))
    try:
        explorer.refresh_weights()
        explorer.join()
        handled: list[int] = []
        wait_until(lambda: handled.append(explorer.run_batch()) or sum(handled) >= len(tasks), timeout=60, interval=0,
                   what=f"{len(tasks)} tasks handled")
        experiences.wait_for(lambda: len(experiences.groups) == len(tasks), timeout_s=20, what="4 groups")
    finally:
        explorer.close("test over")
        experiences.close()
    char_accuracy = resolve("char_accuracy")[1]
    by_task = {t.task_id: t for t in tasks}
    for group in experiences.groups:
        assert len(group.samples) == 2 and group.greedy_reward is not None
        task: TaskRecord = by_task[group.task_id]
        text = greedy_decode(engine, group.samples[0].prompt_tokens, max_tokens=4)
        assert group.greedy_reward == pytest.approx(char_accuracy(text, task).score)
