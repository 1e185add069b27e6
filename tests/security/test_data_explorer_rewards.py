"""Issue 29, item 3, at the explorers: a workflow whose rewards are not the reward function's (an environment's
return, a plugin workflow) can produce any number; an explorer produces no group holding a reward outside
run.reward_min .. reward_max, it dead-letters the task with the reason and goes on. A real broker, the tiny
model on the transformers engine, the explorer in this process."""
from __future__ import annotations

import pytest

from rft.engine import TransformersEngine
from rft.explorer.main import build_explorer
from rft.rewards import build_reward
from rft.run.config import config_from_dict
from rft.schema import HEADER_ERROR
from rft.workflows.single_turn import SingleTurn
from tests.integration.explorer_support import Experiences, publish_numbered_tasks
from tests.waiting import wait_until

pytestmark = [pytest.mark.integration]


class GameReturns(SingleTurn):
    """single_turn whose rewards are a game's return: 1e308 on the tasks whose id ends in 1."""

    def finish(self, task, generation):
        result = super().finish(task, generation)
        if task.task_id.endswith("1"):
            for sample in result.samples:
                sample.reward = 1e308
        return result


def test_an_explorer_dead_letters_a_group_with_a_reward_out_of_range(broker, tiny_model, tmp_path, topic_prefix):
    cfg = config_from_dict({
        "run": {"name": topic_prefix, "mode": "explore"},
        "model": {"path": str(tiny_model), "max_prompt_len": 64, "max_response_len": 4},
        "kafka": {"bootstrap_servers": broker.bootstrap_servers, "partitions": 1},
        "explorer": {"engine": "transformers", "n_samples": 2, "max_tokens": 1, "tasks_per_batch": 4,
                     "reward": "char_accuracy", "heartbeat_s": 0.5},
        "data": {"path": "copy_char", "format": "generated", "generated_tasks": 4},
        "sync": {"weight_store": str(tmp_path / "store")},
    })
    tasks = publish_numbered_tasks(cfg)
    explorer = build_explorer(cfg, explorer_id="poisoned", engine=TransformersEngine(tiny_model),
                              workflow=GameReturns(cfg.explorer, cfg.model, build_reward(cfg.explorer)))
    experiences, dead = Experiences(cfg, cfg.topic("experiences")), Experiences(cfg, cfg.topic("dead_letter"))
    try:
        explorer.refresh_weights()
        explorer.join()
        handled: list[int] = []
        wait_until(lambda: handled.append(explorer.run_batch()) or sum(handled) >= len(tasks), timeout=60, interval=0,
                   what=f"{len(tasks)} tasks handled")
        experiences.wait_for(lambda: len(experiences.groups) == 3, timeout_s=20, what="3 groups")
        dead.wait_for(lambda: len(dead.raw) == 1, timeout_s=20, what="1 dead letter")
    finally:
        explorer.close("test over")
        experiences.close()
        dead.close()
    assert sorted(g.task_id for g in experiences.groups) == ["task-0", "task-2", "task-3"]
    assert all(s.reward <= 1 for g in experiences.groups for s in g.samples)
    reason = dict(dead.raw[0].headers)[HEADER_ERROR].decode()
    assert reason.startswith("task cannot be explored: samples[0]: reward 1e+308 is outside "
                             "run.reward_min..run.reward_max"), reason
    assert explorer.stats.dead_letters == 1
