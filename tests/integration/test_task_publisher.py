"""`rft publish CONFIG` against the real broker: every epoch's tasks arrive, keyed by task id, in the seeded order."""
from __future__ import annotations

import json

import pytest
import yaml

from rft.cli import main as rft
from rft.data.selectors import epoch_order
from rft.data.tasks import load_rows, rows_to_tasks
from rft.run.config import load_config
from rft.schema import TaskRecord
from tests.integration.explorer_support import TopicReader

pytestmark = [pytest.mark.integration]


def test_publish_epochs(broker, tmp_path, topic_prefix, capsys):
    rows = [{"q": f"what is {i}+{i}?", "a": 2 * i, "source": "synthetic"} for i in range(7)]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({
        "run": {"name": topic_prefix}, "model": {"path": str(tmp_path)},
        "kafka": {"bootstrap_servers": broker.bootstrap_servers, "partitions": 1},
        "data": {"path": str(tmp_path / "d.jsonl"), "prompt_key": "q", "answer_key": "a", "epochs": 3,
                 "shuffle_seed": 11, "prompt_template": "Q: {prompt}\nA:"}}))
    assert rft(["publish", str(path)]) == 0
    assert f"published 21 tasks to {topic_prefix}.tasks" in capsys.readouterr().out

    cfg = load_config(path)
    reader = TopicReader(cfg, cfg.topic("tasks"))
    reader.wait_for(lambda: len(reader.records) == 21, timeout_s=20, what="21 tasks")
    reader.close()
    tasks = reader.records
    assert all(isinstance(t, TaskRecord) for t in tasks)
    assert [m.key.decode() for m in reader.raw] == [t.task_id for t in tasks]
    base = rows_to_tasks(load_rows(cfg.data), cfg.data, run_id=cfg.run.name)
    expected = [(base[i].task_id, epoch) for epoch in range(3) for i in epoch_order(7, epoch, 11)]
    assert [(t.task_id, t.epoch) for t in tasks] == expected
    first = next(t for t in tasks if t.task_id == base[3].task_id)
    assert first.prompt == "Q: what is 3+3?\nA:" and first.answer == 6 and first.metadata == {"source": "synthetic"}
    assert len({t.group_id for t in tasks}) == 21
