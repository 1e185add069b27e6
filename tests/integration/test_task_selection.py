"""Task selection against the real broker: tasks are published to the tasks topic and read back from it; rewards
are written as experience groups to the experiences topic and read back by the online publisher.

- `sequential` over a weighted mix of two task sets: the picks follow the weights, each set in its order;
- `curriculum`, greedy: after one round, tasks are revisited in the order of |mean reward - 0.5| (a plain sort);
- `curriculum`, sampled: a publisher restarted from the topics picks exactly what an uninterrupted one picks;
- `rft publish` online: never more than `data.tasks_ahead` tasks ahead of the explorers' committed offsets, and
  SIGTERM stops it cleanly."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import yaml

from rft.cli.prepare import publish_run_tasks
from rft.data.selectors import RewardStats
from rft.data.tasks import build_picker, publish_tasks, published_groups
from rft.explorer.publisher import OnlinePublisher
from rft.run.config import config_from_dict
from rft.schema import ExperienceGroup, Sample, TaskRecord, decode, encode, group_id_for
from rft.transport import connect
from rft.transport.run_topics import RunTopics, consumer_group
from tests.waiting import wait_until

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
RUN = "sel"


def online_publisher(cfg) -> OnlinePublisher:
    return OnlinePublisher(cfg.data, cfg.explorer, RunTopics.of(cfg), cfg.kafka)


def write_rows(path: Path, n: int) -> Path:
    path.write_text("".join(json.dumps({"q": f"question {i}", "a": str(i)}) + "\n" for i in range(n)))
    return path


def make_cfg(bootstrap: str, prefix: str, data: dict):
    return config_from_dict({
        "run": {"name": RUN}, "model": {"path": "unused"},
        "kafka": {"bootstrap_servers": bootstrap, "topic_prefix": prefix, "partitions": 1},
        "data": {"prompt_key": "q", "answer_key": "a", **data}})


def read_topic(cfg, topic: str) -> list:
    source = connect(cfg.kafka, cfg.kafka.bootstrap_servers).source()
    try:
        return [decode(m.value, m.headers) for m in source.read_range(topic)]
    finally:
        source.close()


def record_rewards(cfg, rewards_by_task: dict[tuple[str, int], list[float]]) -> None:
    """One experience group per (task id, epoch) with the given sample rewards, as an explorer would write it."""
    sink = connect(cfg.kafka, cfg.kafka.bootstrap_servers).sink()
    for (task_id, epoch), rewards in rewards_by_task.items():
        samples = [Sample(sample_index=j, prompt_tokens=np.array([1, 2]), response_tokens=np.array([3]),
                          logprobs=np.array([-0.5]), loss_mask=np.array([1]), reward=r) for j, r in enumerate(rewards)]
        group = ExperienceGroup(run_id=RUN, task_id=task_id, group_id=group_id_for(RUN, task_id, epoch), attempt=0,
                                explorer_id="explorer-test", policy_version=0, samples=samples)
        value, headers = encode(group)
        sink.send(cfg.topic("experiences"), value, key=group.group_id, headers=headers)
    sink.flush()
    sink.close()


def picks(tasks: list[TaskRecord]) -> list[tuple[str, int]]:
    return [(t.task_id, t.epoch) for t in tasks]


def test_sequential_mix_follows_the_weights(bootstrap, topic_prefix, tmp_path):
    cfg = make_cfg(bootstrap, topic_prefix, {"selector": "sequential", "mix": [
        {"path": str(write_rows(tmp_path / "a.jsonl", 6)), "weight": 3},
        {"path": "copy_char", "format": "generated", "generated_tasks": 2, "epochs": 2, "prompt_key": "prompt",
         "answer_key": "answer", "weight": 1}]})
    assert publish_tasks(cfg.data, RunTopics.of(cfg), cfg.kafka, progress=False) == 10
    tasks = read_topic(cfg, cfg.topic("tasks"))
    sets = [int(t.task_id[1]) for t in tasks]
    assert all(t.task_id.startswith(f"m{s}.r") for t, s in zip(tasks, sets, strict=True))
    # While both sets have tasks left, set 0 holds 3/4 of every prefix of the picks (to within one pick).
    for k in range(1, 8):
        assert abs(sets[:k].count(0) - 0.75 * k) < 1, sets
    assert sets.count(0) == 6 and sets.count(1) == 4
    first_set = [t for t in tasks if t.task_id.startswith("m0.")]
    assert [t.prompt for t in first_set] == [f"question {i}" for i in range(6)] and {t.epoch for t in first_set} == {0}
    toy = [t.task_id for t in build_picker(cfg.data, run_id=cfg.run.name).sets[1].tasks]  # dataset order
    assert picks([t for t in tasks if t.task_id.startswith("m1.")]) == [(toy[0], 0), (toy[1], 0), (toy[0], 1),
                                                                         (toy[1], 1)]


def test_a_publish_cut_short_is_completed_and_a_whole_one_left_alone(bootstrap, topic_prefix, tmp_path, capsys):
    """`rft run` publishes the tasks a cut-short publish (Ctrl-C before the broker acknowledged them all) left out,
    each once; a topic that holds the whole set is not written again. Before, a resumed run found 1 of 8 tasks,
    published nothing, and waited for groups that could never come (tests/e2e/test_stages_run.py hung on it)."""
    cfg = make_cfg(bootstrap, topic_prefix, {"path": str(write_rows(tmp_path / "a.jsonl", 8)), "epochs": 2})
    topics = RunTopics.of(cfg)
    every = [t.group_id for t in build_picker(cfg.data, run_id=topics.run).drain()]
    assert publish_tasks(cfg.data, topics, cfg.kafka, skip=set(every[3:])) == 3  # the cut: 3 of 16 made it
    publish_run_tasks(cfg)
    assert "held 3 of its tasks (a publish cut short): published the 13 it lacked" in capsys.readouterr().out
    on_topic = [t.group_id for t in read_topic(cfg, topics.tasks)]
    assert sorted(on_topic) == sorted(every) and published_groups(topics, cfg.kafka) == set(every)
    publish_run_tasks(cfg)  # a resumed run on a whole topic
    assert "already holds 16 tasks: not publishing again" in capsys.readouterr().out
    assert len(read_topic(cfg, topics.tasks)) == 16


def test_curriculum_revisits_tasks_closest_to_half_first(bootstrap, topic_prefix, tmp_path):
    cfg = make_cfg(bootstrap, topic_prefix, {"selector": "curriculum", "epochs": 2, "path": str(
        write_rows(tmp_path / "d.jsonl", 6)), "curriculum": {"temperature": 0.0}})
    publisher = online_publisher(cfg)
    try:
        publisher.restore()
        first = publisher.publish(6)  # no rewards yet: a task waiting for its rewards is not picked again
        assert sorted(t.task_id for t in first) == sorted(t.task_id for t in publisher.picker.sets[0].tasks)
        assert {t.epoch for t in first} == {0}
        means = [0.0, 0.3, 0.5, 0.9, 0.8, 0.45]
        rewards = {(t.task_id, 0): [means[i] - 0.1, means[i] + 0.1, means[i]] for i, t in
                   enumerate(publisher.picker.sets[0].tasks)}
        record_rewards(cfg, rewards)
        assert publisher.sync_rewards() == 6
        second = publisher.publish(6)
        assert publisher.publish(1) == []  # 6 tasks x 2 epochs: used up
    finally:
        publisher.close()
    ids = [t.task_id for t in publisher.picker.sets[0].tasks]
    expected = sorted(range(6), key=lambda i: abs(np.mean(rewards[(ids[i], 0)]) - 0.5))
    assert picks(second) == [(ids[i], 1) for i in expected]
    assert picks(read_topic(cfg, cfg.topic("tasks"))) == picks(first + second)


def test_curriculum_restarted_continues_like_an_uninterrupted_publisher(bootstrap, topic_prefix, tmp_path):
    data = {"selector": "curriculum", "epochs": 3, "shuffle_seed": 5, "path": str(write_rows(tmp_path / "d.jsonl", 8)),
            "curriculum": {"temperature": 0.2, "prior": 0.3}}
    whole, restarted = make_cfg(bootstrap, f"{topic_prefix}-a", data), make_cfg(bootstrap, f"{topic_prefix}-b", data)
    rng = np.random.default_rng(3)

    uninterrupted = online_publisher(whole)
    uninterrupted.restore()
    first = uninterrupted.publish(8)
    rewards = {(t.task_id, t.epoch): list(rng.choice([0.0, 1.0], size=4, p=[p, 1 - p]))
               for t, p in zip(first, np.linspace(0.05, 0.95, 8), strict=True)}
    record_rewards(whole, rewards)
    uninterrupted.sync_rewards()
    expected = uninterrupted.publish(8)
    uninterrupted.close()

    before_crash = online_publisher(restarted)
    before_crash.restore()
    assert picks(before_crash.publish(8)) == picks(first)
    before_crash.close()
    record_rewards(restarted, rewards)
    after = online_publisher(restarted)
    try:
        after.restore()
        assert after.picker.picks == 8 and after.stats.groups == 8
        assert picks(after.publish(8)) == picks(expected)
    finally:
        after.close()

    blind = build_picker(whole.data, run_id=whole.run.name)  # the same published history, without the rewards,
    # picks otherwise
    for t in first:
        blind.record(t.task_id)
    assert picks([blind.next(RewardStats()) for _ in range(8)]) != picks(expected)


def test_rft_publish_online_keeps_a_bounded_lead_and_stops_on_sigterm(bootstrap, topic_prefix, tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({
        "run": {"name": RUN}, "model": {"path": "unused"},
        "kafka": {"bootstrap_servers": bootstrap, "topic_prefix": topic_prefix, "partitions": 1},
        "data": {"path": str(write_rows(tmp_path / "d.jsonl", 10)), "prompt_key": "q", "answer_key": "a",
                 "selector": "curriculum", "tasks_ahead": 3}}))
    cfg = make_cfg(bootstrap, topic_prefix, {"path": str(tmp_path / "d.jsonl"), "selector": "curriculum"})
    publisher = subprocess.Popen([sys.executable, "-m", "rft.cli", "publish", str(config)], cwd=REPO,
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                 env=dict(os.environ, PYTHONUNBUFFERED="1"))
    explorer = None
    try:
        wait_for_tasks(cfg, 3, publisher)
        time.sleep(2.0)  # a test of absence: nothing more may be published in that time
        assert count_tasks(cfg) == 3  # the lead is full: nothing more until the explorers commit
        explorer = connect(cfg.kafka, bootstrap).source(group=consumer_group(cfg), topics=[cfg.topic("tasks")])
        taken = []
        wait_until(lambda: len(taken) == 2, timeout=60, what="2 tasks taken",
                   between=lambda: taken.extend(explorer.poll(timeout_s=0.5, max_records=2 - len(taken))))
        explorer.commit({taken[-1].position: taken[-1].offset + 1})
        wait_for_tasks(cfg, 5, publisher)
        time.sleep(2.0)  # a test of absence, as above
        assert count_tasks(cfg) == 5
        publisher.send_signal(signal.SIGTERM)
        out, _ = publisher.communicate(timeout=30)
    finally:
        if explorer is not None:
            explorer.close()
        if publisher.poll() is None:
            publisher.kill()
    assert publisher.returncode == 0, out
    assert "[publisher] stopped after 5 tasks" in out and "published 5 tasks" in out


def count_tasks(cfg) -> int:
    source = connect(cfg.kafka, cfg.kafka.bootstrap_servers).source()
    try:
        return sum(source.end_offsets(cfg.topic("tasks")).values())
    finally:
        source.close()


def wait_for_tasks(cfg, n: int, process: subprocess.Popen, timeout_s: float = 60) -> None:
    """Until `n` tasks are on the tasks topic; fails at once if `rft publish` exited (with its output)."""
    def published() -> bool:
        try:
            return count_tasks(cfg) >= n
        except Exception:  # the topic is not created yet
            return False

    wait_until(published, timeout=timeout_s, what=f"{n} tasks published", interval=0.3, alive=[process],
               context=lambda: process.stdout.read() if process.poll() is not None else "")
