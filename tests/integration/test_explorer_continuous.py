"""`explorer.continuous: true` with the real broker and a real vLLM engine (tests/integration/continuous_probe.py in
a subprocess): weights versions published mid-run are loaded only when nothing is in flight, every group's
`policy_version` (vLLM's per-token version stamps) is the version its request was submitted and finished with, every
task is produced once, and no commit ever passes a task whose group was not yet sent."""
from __future__ import annotations

import json
import subprocess
import sys
from collections import defaultdict

import pytest

from rft.data.tasks import load_rows, rows_to_tasks
from rft.schema import TaskRecord
from rft.transport import connect
from tests.integration.explorer_support import (
    REPO,
    Experiences,
    TopicReader,
    create_topics,
    load,
    subprocess_env,
    write_config,
)

pytestmark = [pytest.mark.integration, pytest.mark.vllm]


def test_continuous_reloads_between_versions(broker, tiny_model, tmp_path, topic_prefix):
    config = write_config(tmp_path / "run.yaml", run=topic_prefix, bootstrap=broker.bootstrap_servers,
                          model=tiny_model, store=tmp_path / "store", partitions=2, continuous=True, max_inflight=3,
                          n_samples=3, max_tokens=8, admission="all", temperature=1.0)
    cfg = load(config)
    create_topics(cfg)
    tasks = rows_to_tasks(load_rows(cfg.data), cfg.data, run_id=cfg.run.name)
    oversized = TaskRecord(run_id=topic_prefix, task_id="big", epoch=0, prompt="7" * 40, answer="7")
    published = tasks[:5] + [oversized] + tasks[5:]
    sink = connect(cfg.kafka, broker.bootstrap_servers).sink()
    for t in published:
        sink.send_record(cfg.topic("tasks"), t, key=t.task_id)
    sink.flush()
    sink.close()

    proc = subprocess.run([sys.executable, str(REPO / "tests/integration/continuous_probe.py"), str(config)],
                          capture_output=True, text=True, timeout=600, env=subprocess_env())
    marker = [line for line in proc.stdout.splitlines() if line.startswith("PROBE-RESULT ")]
    assert proc.returncode == 0 and marker, f"probe failed ({proc.returncode}):\n{proc.stderr[-4000:]}"
    out = json.loads(marker[0].removeprefix("PROBE-RESULT "))

    experiences, dead, tasks_topic = (Experiences(cfg, cfg.topic("experiences")),
                                      TopicReader(cfg, cfg.topic("dead_letter")), TopicReader(cfg, cfg.topic("tasks")))
    try:
        experiences.wait_for(lambda: len(experiences.groups) >= len(tasks), timeout_s=20, what="all groups")
        dead.wait_for(lambda: len(dead.raw) >= 1, timeout_s=20, what="the dead letter")
        tasks_topic.wait_for(lambda: len(tasks_topic.raw) >= len(published), timeout_s=20, what="the tasks")
    finally:
        for reader in (experiences, dead, tasks_topic):
            reader.close()
    groups = experiences.groups

    # every task once; the oversized one dead-lettered with its reason
    assert sorted(g.group_id for g in groups) == sorted(t.group_id for t in tasks)
    assert len(dead.raw) == 1 and "over model.max_prompt_len" in dict(dead.raw[0].headers)["rft-error"].decode()
    assert out["reason"] == "idle" and out["stats"]["groups"] == len(tasks)

    # reloads: both versions, each loaded while vLLM had no unfinished request
    assert [v for v, _ in out["loads"]] == [1, 2], out["loads"]
    assert all(unfinished == 0 for _, unfinished in out["loads"]), out["loads"]
    assert out["reloads"] == [[1, 0], [2, 0]]

    # versions: each request finished under the version it was submitted with, and vLLM stamped every completion so
    assert sorted(out["submitted"]) == sorted(out["finished"]) and len(out["submitted"]) == len(tasks)
    for request_id, (finished_version, completion_versions) in out["finished"].items():
        assert finished_version == out["submitted"][request_id]
        assert completion_versions == [finished_version] * 3, request_id
    by_group = {g.group_id: g for g in groups}
    for request_id, submitted in out["submitted"].items():
        group = by_group[request_id.rsplit("#", 1)[0]]
        assert group.policy_version == submitted
        assert group.metadata["submitted_version"] == group.metadata["finished_version"] == submitted
        assert len(group.samples) == 3
    assert {g.policy_version for g in groups} == {0, 1, 2}  # the run really crossed two reloads

    # commits: a committed offset never passes a task whose group (or dead letter) was not sent before the commit
    key_at = {(m.position, m.offset): m.key.decode() if isinstance(m.key, bytes) else m.key for m in tasks_topic.raw}
    produced_key = {t.task_id: t.group_id for t in published}
    for offsets, sent_count in out["commits"]:
        sent = {key for _, key in out["sent"][:sent_count]}
        for position, committed in offsets.items():
            below = [produced_key[key_at[(position, o)]] for o in range(committed)]
            missing = [g for g in below if g not in sent and g != oversized.group_id]
            assert not missing, (position, committed, missing)
    ends = defaultdict(int)
    for m in tasks_topic.raw:
        ends[m.position] = max(ends[m.position], m.offset + 1)
    assert out["committed"] == dict(ends)
    assert len(out["commits"]) > 2  # committed as groups finished, not once at the end
