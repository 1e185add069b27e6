"""The task publisher: a local dataset -> TaskRecords on the run's tasks topic (`rft publish CONFIG`).

Sources (`data.format`): `jsonl` (one JSON object per line), `parquet`, `hf_disk` (a Hugging Face
dataset saved with `save_to_disk`; a DatasetDict must name its split as `path:split`), `generated`
(a toy task from rft.workflows.toy_tasks named by `data.path`, `data.generated_tasks` rows).

For each epoch e (0-based) the rows are shuffled with `random.Random(data.shuffle_seed + e)` (no shuffle
when the seed is null), and each row becomes one TaskRecord:
- `task_id`: `r<row index>-<8 hex of sha1(prompt, answer)>`: stable across epochs and re-publishes
  of the same file, and distinct for duplicate rows;
- `prompt`: `data.prompt_template` formatted with the row's fields, where `{prompt}` is the row's
  `data.prompt_key` field;
- `answer`: the row's `data.answer_key` field (the ground truth; `answer_key: ""` for none);
- `metadata`: the row's other fields (e.g. `numbers` for countdown, `alphabet` for toy tasks).
A row that lacks a key or whose template does not format is an error naming the row and the key;
nothing is published then (rows are all checked before the first send).
Records are keyed by task id; `publish_tasks` returns after the broker acknowledged every record.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import random
import sys
from pathlib import Path
from typing import Any, Iterator

from rft.config import Config, DataConfig
from rft.schema import TaskRecord


class DatasetError(ValueError):
    pass


def load_rows(data: DataConfig, *, section: str = "data") -> list[dict[str, Any]]:
    """The dataset's rows as plain dicts (JSON-compatible values). Errors name `<section>.path`."""
    if data.format == "generated":
        from rft.workflows.toy_tasks import generate_rows
        try:
            return generate_rows(data.path, data.generated_tasks, seed=data.shuffle_seed or 0)
        except ValueError as e:
            raise DatasetError(f"{section}.path: {e}") from None
    path = Path(data.path.split(":")[0] if data.format == "hf_disk" else data.path)
    if not data.path or not path.exists():
        raise DatasetError(f"{section}.path: dataset {data.path!r} does not exist")
    rows = {"jsonl": _jsonl_rows, "parquet": _parquet_rows, "hf_disk": _hf_disk_rows}[data.format](data.path)
    if not rows:
        raise DatasetError(f"{section}.path: dataset {data.path} has no rows")
    return rows


def _jsonl_rows(path: str) -> list[dict[str, Any]]:
    rows = []
    with open(path) as f:
        for n, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise DatasetError(f"{path}:{n}: not valid JSON: {e.msg}") from None
            if not isinstance(row, dict):
                raise DatasetError(f"{path}:{n}: expected a JSON object, got {type(row).__name__}")
            rows.append(row)
    return rows


def _parquet_rows(path: str) -> list[dict[str, Any]]:
    import pyarrow.parquet as pq
    return pq.read_table(path).to_pylist()


def _hf_disk_rows(spec: str) -> list[dict[str, Any]]:
    from datasets import DatasetDict, load_from_disk

    path, _, split = spec.partition(":")
    dataset = load_from_disk(path)
    if isinstance(dataset, DatasetDict):
        if not split:
            raise DatasetError(f"data.path: {path} holds splits {list(dataset)}; name one as {path}:SPLIT")
        if split not in dataset:
            raise DatasetError(f"data.path: {path} has no split {split!r} (splits: {list(dataset)})")
        dataset = dataset[split]
    return dataset.to_list()


def task_id_for(index: int, prompt: str, answer: Any) -> str:
    digest = hashlib.sha1(json.dumps([prompt, answer], sort_keys=True, default=str).encode()).hexdigest()[:8]
    return f"r{index:07d}-{digest}"


def rows_to_tasks(rows: list[dict[str, Any]], cfg: Config, *, data: DataConfig | None = None,
                  section: str = "data") -> list[TaskRecord]:
    """Epoch 0's tasks, in dataset order (validates every row). `data` (default `cfg.data`) says how rows become
    tasks; errors name its keys as `<section>.key`."""
    data = data or cfg.data
    tasks = []
    for index, row in enumerate(rows):
        where = f"{data.path} row {index}"
        if data.prompt_key not in row:
            raise DatasetError(f"{where}: no field {data.prompt_key!r} ({section}.prompt_key); fields: {sorted(row)}")
        if data.answer_key and data.answer_key not in row:
            raise DatasetError(f"{where}: no field {data.answer_key!r} ({section}.answer_key); fields: {sorted(row)}")
        fields = {**row, "prompt": row[data.prompt_key]}
        try:
            prompt = data.prompt_template.format(**fields)
        except (KeyError, IndexError, ValueError) as e:
            raise DatasetError(f"{where}: {section}.prompt_template {data.prompt_template!r} does not format: "
                               f"{type(e).__name__}: {e}") from None
        answer = row[data.answer_key] if data.answer_key else None
        metadata = {k: v for k, v in row.items() if k not in (data.prompt_key, data.answer_key)}
        tasks.append(TaskRecord(run_id=cfg.run.name, task_id=task_id_for(index, prompt, answer), epoch=0,
                                prompt=prompt, answer=answer, metadata=metadata))
    return tasks


def epoch_order(n: int, epoch: int, shuffle_seed: int | None) -> list[int]:
    order = list(range(n))
    if shuffle_seed is not None:
        random.Random(shuffle_seed + epoch).shuffle(order)
    return order


def iter_epochs(tasks: list[TaskRecord], *, epochs: int, shuffle_seed: int | None) -> Iterator[TaskRecord]:
    """Every task once per epoch, each epoch in its own seeded order."""
    for epoch in range(epochs):
        for i in epoch_order(len(tasks), epoch, shuffle_seed):
            t = tasks[i]
            yield TaskRecord(run_id=t.run_id, task_id=t.task_id, epoch=epoch, prompt=t.prompt, answer=t.answer,
                             metadata=t.metadata)


def publish_tasks(cfg: Config, *, bootstrap: str | None = None, progress: bool | None = None) -> int:
    """Publish every epoch's tasks to `cfg.topic("tasks")` (created if missing); returns how many."""
    from tqdm import tqdm

    from rft.transport import Admin, RecordSink

    bootstrap = bootstrap or cfg.kafka.bootstrap_servers
    tasks = rows_to_tasks(load_rows(cfg.data), cfg)
    topic = cfg.topic("tasks")
    admin = Admin(cfg.kafka, bootstrap)
    try:
        admin.create_topics([topic])
    finally:
        admin.close()
    total = len(tasks) * cfg.data.epochs
    show = cfg.monitor.progress if progress is None else progress
    sink = RecordSink(cfg.kafka, bootstrap, client_id=f"{cfg.run.name}-publisher")
    try:
        futures = []
        for task in tqdm(iter_epochs(tasks, epochs=cfg.data.epochs, shuffle_seed=cfg.data.shuffle_seed),
                         total=total, desc=f"publish {topic}", unit="task", disable=not show or total < 1000):
            futures.append(sink.send_record(topic, task, key=task.task_id))
        sink.flush()
        for future in futures:
            future.get(timeout=cfg.kafka.request_timeout_ms / 1000)
    finally:
        sink.close()
    return total


def main(argv: list[str]) -> int:
    from rft.cli import add_config_arguments, config_from_args

    parser = argparse.ArgumentParser(prog="rft publish", description="Create the run's topics where missing "
                                     "and publish a dataset's tasks to its tasks topic (every epoch, seeded shuffle).")
    add_config_arguments(parser)
    cfg = config_from_args(parser.parse_args(argv))
    if cfg.kafka.bootstrap_servers == "embedded":
        print("rft publish: kafka.bootstrap_servers is 'embedded'; publishing needs the run's broker address "
              "(--set kafka.bootstrap_servers=HOST:PORT)", file=sys.stderr)
        return 2
    from rft.topics import create_run_topics

    try:
        create_run_topics(cfg)
        count = publish_tasks(cfg)
    except DatasetError as e:
        print(f"rft publish: {e}", file=sys.stderr)
        return 2
    print(f"published {count} tasks to {cfg.topic('tasks')}")
    return 0
