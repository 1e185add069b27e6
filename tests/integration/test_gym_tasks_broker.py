"""reasoning-gym task sets through the real broker: the task publisher sends basic_arithmetic tasks to a topic, they
are read back, and known replies (right, wrong, malformed, missing tags) are scored by the registered rewards; the
expected scores are reasoning-gym's own `score_answer` on the same entries, built here independently."""
from __future__ import annotations

import dataclasses

import pytest
import reasoning_gym

from rft.data.tasks import publish_tasks
from rft.rewards import build_reward
from rft.rewards.registry import TaskError
from rft.run.loading import run_config_from_dict
from rft.schema import TaskRecord
from rft.transport.run_topics import RunTopics
from rft.workflows.registry import score_group
from tests.integration.explorer_support import TopicReader

pytestmark = [pytest.mark.integration]

OPTIONS = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2}
SIZE, SEED = 8, 5


def published_tasks(bootstrap: str, run: str, tmp_path) -> list[TaskRecord]:
    cfg = run_config_from_dict({
        "run": {"name": run}, "model": {"path": str(tmp_path)},
        "kafka": {"bootstrap_servers": bootstrap, "partitions": 1},
        "data": {"format": "reasoning_gym", "path": "basic_arithmetic", "options": OPTIONS, "generated_tasks": SIZE,
                 "shuffle_seed": SEED, "selector": "sequential",
                 "prompt_template": "{prompt} Give only the number."}})
    assert publish_tasks(cfg.data, RunTopics.of(cfg), cfg.kafka) == SIZE
    reader = TopicReader(cfg, cfg.topic("tasks"))
    reader.wait_for(lambda: len(reader.records) == SIZE, timeout_s=20, what=f"{SIZE} tasks")
    reader.close()
    assert all(isinstance(t, TaskRecord) for t in reader.records)
    return reader.records


def test_published_tasks_score_known_replies_as_reasoning_gym_does(bootstrap, topic_prefix, tmp_path):
    tasks = published_tasks(bootstrap, topic_prefix, tmp_path)
    dataset = reasoning_gym.create_dataset("basic_arithmetic", seed=SEED, size=SIZE, **OPTIONS)
    assert [t.prompt for t in tasks] == [f"{e['question']} Give only the number." for e in dataset]
    assert len({t.task_id for t in tasks}) == SIZE
    last_number = build_reward(run_config_from_dict({"model": {"path": "m"},
                                                     "explorer": {"reward": "reasoning_gym"}}).explorer)
    tagged = build_reward(run_config_from_dict({"model": {"path": "m"},
                                                "explorer": {"reward": "reasoning_gym_tagged"}}).explorer)
    for task, entry in zip(tasks, dataset, strict=True):
        right, wrong = entry["answer"], str(int(entry["answer"]) + 1)
        replies = [f"Sure! {entry['question']} The answer is {right}.", f"It is {wrong}", "no digits at all",
                   f"<answer>{right}</answer>", ""]
        expected = [dataset.score_answer(a, entry) for a in (right, wrong, None, right, None)]
        assert expected[:2] == [1.0, 0.0]
        assert [r.score for r in last_number.score(replies, task)] == expected
        # tagged: only a reply with <answer> tags has an answer; the others (missing tags) score 0
        assert [r.score for r in tagged.score(replies, task)] == [0.0, 0.0, 0.0, 1.0, 0.0]
        components = last_number.score(replies[:3], task)
        assert [c.components for c in components] == [{"extracted": 1.0, "correct": 1.0},
                                                      {"extracted": 1.0, "correct": 0.0},
                                                      {"extracted": 0.0, "correct": 0.0}]


def test_a_tampered_task_record_is_not_scored(bootstrap, topic_prefix, tmp_path):
    task = published_tasks(bootstrap, topic_prefix, tmp_path)[0]
    reward = build_reward(run_config_from_dict({"model": {"path": "m"},
                                                "explorer": {"reward": "reasoning_gym"}}).explorer)
    spec = task.metadata["reasoning_gym"]
    tampered = {
        "no spec": {},
        "index out of range": {"reasoning_gym": {**spec, "index": SIZE}},
        "seed not an int": {"reasoning_gym": {**spec, "seed": "5"}},
        "extra field": {"reasoning_gym": {**spec, "code": "import os"}},
        "unknown dataset": {"reasoning_gym": {**spec, "dataset": "no_such_dataset"}},
        "bad options": {"reasoning_gym": {**spec, "options": {"min_terms": 3, "max_terms": 2}}},
    }
    for what, metadata in tampered.items():
        with pytest.raises(TaskError):
            reward.score(["42"], dataclasses.replace(task, metadata=metadata))
        # a workflow turns it into the group's error (the explorer dead-letters the task)
        assert score_group(reward, ["42"], dataclasses.replace(task, metadata=metadata)).startswith(
            "task cannot be scored"), what
    with pytest.raises(TaskError, match="is not the answer"):
        reward.score(["42"], dataclasses.replace(task, answer="123456"))
