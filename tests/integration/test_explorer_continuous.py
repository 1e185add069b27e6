"""`explorer.continuous: true` with the real broker and a real vLLM engine (tests/integration/continuous_probe.py in
a subprocess), both ways of taking a new weights version. Draining: versions published mid-run are loaded only when
nothing is in flight, and every group's `policy_version` (vLLM's per-token version stamps) is the version its request
was submitted and finished with. In flight (`explorer.inflight_updates`): versions are loaded while vLLM has
unfinished requests, samples record the version of each token (some two versions), and each group's `policy_version`
is its oldest token's, on the wire. Both: every task is produced once, no commit ever passes a task whose group was
not yet sent, and the engine was warmed up once while the broker held the explorer's join."""
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


@pytest.mark.parametrize("in_flight", [False, True], ids=["drain", "in_flight"])
def test_continuous_reloads_between_versions(broker, tiny_model, tmp_path, topic_prefix, in_flight):
    config = write_config(tmp_path / "run.yaml", run=topic_prefix, bootstrap=broker.bootstrap_servers,
                          model=tiny_model, store=tmp_path / "store", partitions=2, continuous=True, max_inflight=3,
                          n_samples=3, max_tokens=8, admission="all", temperature=1.0, inflight_updates=in_flight)
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

    proc = subprocess.run([sys.executable, str(REPO / "tests/integration/continuous_probe.py"), str(config),
                           str(len(tasks))],
                          capture_output=True, text=True, timeout=600, env=subprocess_env())
    marker = [line for line in proc.stdout.splitlines() if line.startswith("PROBE-RESULT ")]
    assert proc.returncode == 0 and marker, f"probe failed ({proc.returncode}):\n{proc.stderr[-4000:]}"
    out = json.loads(marker[0].removeprefix("PROBE-RESULT "))
    assert out["reason"] == "stopped" and out["stats"]["groups"] == len(tasks), (
        f"the explorer went {out['reason']} after {out['stats']['groups']} of {len(tasks)} groups, reloads "
        f"{out['reloads']}:\n{proc.stderr[-4000:]}")

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

    assert [v for v, _ in out["loads"]] == [1, 2], out["loads"]
    # the engine was warmed up once, while the broker held the join: one `generate` of tasks_per_batch prompts
    assert out["warm_up"] == [f"generate-1-{i}" for i in range(cfg.explorer.tasks_per_batch)], out["warm_up"]
    assert sorted(out["submitted"]) == sorted(out["finished"]) and len(out["submitted"]) == len(tasks)
    by_group = {g.group_id: g for g in groups}
    if in_flight:
        check_in_flight_versions(out, by_group)
    else:
        check_drained_versions(out, by_group)

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


def check_drained_versions(out: dict, by_group: dict) -> None:
    """Both versions loaded while vLLM had no unfinished request; each request finished under the version it was
    submitted with, and vLLM stamped every completion so."""
    assert all(unfinished == 0 for _, unfinished in out["loads"]), out["loads"]
    assert out["reloads"] == [[1, 0], [2, 0]]
    for request_id, (finished_version, completion_versions, _) in out["finished"].items():
        assert finished_version == out["submitted"][request_id]
        assert completion_versions == [finished_version] * 3, request_id
    for request_id, submitted in out["submitted"].items():
        group = by_group[request_id.rsplit("#", 1)[0]]
        assert group.policy_version == submitted
        assert group.metadata["submitted_version"] == group.metadata["finished_version"] == submitted
        assert len(group.samples) == 3
    assert {g.policy_version for g in by_group.values()} == {0, 1, 2}  # the run really crossed two reloads


def check_in_flight_versions(out: dict, by_group: dict) -> None:
    """Both versions loaded while vLLM had unfinished requests; every sample on the broker carries its tokens'
    versions as vLLM stamped them, some samples two versions, and each group's policy_version is its oldest token's."""
    assert all(unfinished > 0 for _, unfinished in out["loads"]), out["loads"]
    assert [v for v, _ in out["reloads"]] == [1, 2] and all(tasks > 0 for _, tasks in out["reloads"]), out["reloads"]
    spanning = 0
    for request_id, (finished_version, _, token_versions) in out["finished"].items():
        group = by_group[request_id.rsplit("#", 1)[0]]
        submitted = out["submitted"][request_id]
        assert [s.token_versions.tolist() for s in group.samples] == token_versions, request_id
        for versions in token_versions:
            assert versions == sorted(versions) and submitted <= versions[0] and versions[-1] <= finished_version
            spanning += len(set(versions)) > 1
        assert group.policy_version == min(min(v) for v in token_versions)
        assert group.metadata["submitted_version"] == submitted
        assert group.metadata["finished_version"] == finished_version
    assert spanning >= 2, "samples whose tokens come from two versions (one per reload at least)"
