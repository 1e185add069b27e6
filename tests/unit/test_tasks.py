"""Task publisher logic: dataset formats, templates, deterministic ids, seeded epochs, clear errors; toy data."""
from __future__ import annotations

import json

import pytest

from rft.data.tasks import DatasetError, build_picker, load_rows, rows_to_tasks
from rft.data.toy_tasks import generate_rows
from rft.data.toy_tasks import main as toy_main
from rft.run.config import config_from_dict

ROWS = [{"question": f"q{i}", "answer": str(i), "level": i % 3} for i in range(20)]


def cfg_for(path, **data):
    return config_from_dict({"run": {"name": "demo"}, "model": {"path": "unused"},
                             "data": {"path": str(path), **data}})


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_jsonl_template_answer_and_metadata(tmp_path):
    cfg = cfg_for(write_jsonl(tmp_path / "d.jsonl", ROWS), prompt_key="question",
                  prompt_template="Q: {prompt} (level {level})\nA:")
    tasks = rows_to_tasks(load_rows(cfg.data), cfg.data, run_id=cfg.run.name)
    assert len(tasks) == 20
    t = tasks[4]
    assert t.prompt == "Q: q4 (level 1)\nA:" and t.answer == "4" and t.metadata == {"level": 1}
    assert t.run_id == "demo" and t.epoch == 0 and t.group_id == f"demo/{t.task_id}/e0"
    assert len({t.task_id for t in tasks}) == 20


def test_task_ids_are_deterministic_and_distinct_for_duplicate_rows(tmp_path):
    cfg = cfg_for(write_jsonl(tmp_path / "d.jsonl", ROWS[:3] + ROWS[:3]), prompt_key="question")
    ids = [t.task_id for t in rows_to_tasks(load_rows(cfg.data), cfg.data, run_id=cfg.run.name)]
    again = [t.task_id for t in rows_to_tasks(load_rows(cfg.data), cfg.data, run_id=cfg.run.name)]
    assert ids == again and len(set(ids)) == 6


def test_epochs_are_seeded_shuffles_of_every_task(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", ROWS)
    cfg = cfg_for(path, prompt_key="question", epochs=3, shuffle_seed=7)
    tasks = rows_to_tasks(load_rows(cfg.data), cfg.data, run_id=cfg.run.name)
    out = list(build_picker(cfg.data, run_id=cfg.run.name).drain())
    assert [t.epoch for t in out] == [0] * 20 + [1] * 20 + [2] * 20
    per_epoch = [[t.task_id for t in out[e * 20:(e + 1) * 20]] for e in range(3)]
    assert all(sorted(ids) == sorted(t.task_id for t in tasks) for ids in per_epoch)
    assert per_epoch[0] != per_epoch[1]  # each epoch has its own order
    assert [t.task_id for t in build_picker(cfg.data, run_id=cfg.run.name).drain()] == sum(per_epoch, [])
    unshuffled = cfg_for(path, prompt_key="question", shuffle_seed=None)
    drained = build_picker(unshuffled.data, run_id=unshuffled.run.name).drain()
    assert [t.task_id for t in drained] == [t.task_id for t in tasks]


def test_parquet_and_hf_disk(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    from datasets import Dataset, DatasetDict

    pq.write_table(pa.Table.from_pylist(ROWS), tmp_path / "d.parquet")
    cfg = cfg_for(tmp_path / "d.parquet", format="parquet", prompt_key="question")
    assert [t.prompt for t in rows_to_tasks(load_rows(cfg.data), cfg.data, run_id=cfg.run.name)][:2] == ["q0", "q1"]
    DatasetDict({"train": Dataset.from_list(ROWS)}).save_to_disk(str(tmp_path / "hf"))
    cfg = cfg_for(f"{tmp_path / 'hf'}:train", format="hf_disk", prompt_key="question")
    assert rows_to_tasks(load_rows(cfg.data), cfg.data, run_id=cfg.run.name)[3].answer == "3"
    with pytest.raises(DatasetError, match="splits \\['train'\\]; name one"):
        load_rows(cfg_for(tmp_path / "hf", format="hf_disk").data)


def test_generated_toy_tasks():
    cfg = cfg_for("copy_char", format="generated", generated_tasks=50)
    tasks = rows_to_tasks(load_rows(cfg.data), cfg.data, run_id=cfg.run.name)
    assert len(tasks) == 50
    assert all(t.prompt == f":{t.answer}" and t.metadata == {"alphabet": "0123456789"} for t in tasks)
    with pytest.raises(DatasetError, match="data.path: unknown toy task 'copy'"):
        load_rows(cfg_for("copy", format="generated").data)


def test_next_digit_rows_and_jsonl_writer(tmp_path):
    rows = generate_rows("next_digit", 30, seed=1)
    assert all(int(r["answer"]) == (int(r["prompt"][1]) + 1) % 10 for r in rows)
    assert rows == generate_rows("next_digit", 30, seed=1)
    out = tmp_path / "toy.jsonl"
    assert toy_main(["copy_char", str(out), "--count", "12", "--seed", "3"]) == 0
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert lines == generate_rows("copy_char", 12, seed=3)


@pytest.mark.parametrize("content,data,message", [
    ('{"question": "a", "answer": 1}\nnot json\n', {"prompt_key": "question"}, "d.jsonl:2: not valid JSON"),
    ('[1, 2]\n', {}, "d.jsonl:1: expected a JSON object, got list"),
    ('{"question": "a", "answer": 1}\n', {},
     "row 0: no field 'prompt' \\(data.prompt_key\\); fields: \\['answer', 'question'\\]"),
    ('{"question": "a"}\n', {"prompt_key": "question"}, "row 0: no field 'answer' \\(data.answer_key\\)"),
    ('{"question": "a", "answer": 1}\n', {"prompt_key": "question", "prompt_template": "{prompt} {missing}"},
     "row 0: data.prompt_template .* does not format: KeyError"),
])
def test_bad_rows_are_errors_naming_row_and_key(tmp_path, content, data, message):
    (tmp_path / "d.jsonl").write_text(content)
    cfg = cfg_for(tmp_path / "d.jsonl", **data)
    with pytest.raises(DatasetError, match=message):
        rows_to_tasks(load_rows(cfg.data), cfg.data, run_id=cfg.run.name)


def test_missing_dataset_names_the_key(tmp_path):
    with pytest.raises(DatasetError, match="data.path: dataset .*nope.jsonl' does not exist"):
        load_rows(cfg_for(tmp_path / "nope.jsonl").data)
