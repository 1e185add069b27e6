"""Task sets: a local dataset -> TaskRecords; the task publisher (`rft publish CONFIG`).

Sources (`format`): `jsonl` (one JSON object per line), `parquet`, `hf_disk` (a Hugging Face dataset saved
with `save_to_disk`; a DatasetDict must name its split as `path:split`), `generated` (a toy task from
rft.workflows.toy_tasks named by `path`, `generated_tasks` rows). A run has one task set (`data.path`) or
several mixed by weight (`data.mix`, see rft/explorer/selectors.py for how sets and tasks are picked).

Each row becomes one TaskRecord:
- `task_id`: `r<row index>-<8 hex of sha1(prompt, answer)>` (`m<set>.r...` for the sets of `data.mix`): stable
  across epochs and re-publishes of the same file, and distinct for duplicate rows;
- `epoch`: how many times the task was published before (every task once per epoch with `sequential` and
  `shuffle`), so `(task_id, epoch)` names one group;
- `prompt`: `prompt_template` formatted with the row's fields, where `{prompt}` is the row's `prompt_key` field;
- `answer`: the row's `answer_key` field (the ground truth; `answer_key: ""` for none);
- `metadata`: the row's other fields (e.g. `numbers` for countdown, `alphabet` for toy tasks).
A row that lacks a key or whose template does not format is an error naming the row and the key;
nothing is published then (rows are all checked before the first send).

Publishing: a selector that does not read rewards (`sequential`, `shuffle`) has its whole sequence published at
once; `publish_tasks` returns after the broker acknowledged every record. A selector that reads rewards
(`curriculum`) runs online (rft/explorer/publisher.py): `rft publish` then keeps `data.tasks_ahead` tasks ahead of
the explorers until the sequence ends or it is stopped.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rft.config import Config, DataConfig
from rft.explorer.selectors import SetProgress, TaskPicker, build_selector, selector_needs_rewards
from rft.schema import TaskRecord


class DatasetError(ValueError):
    pass


@dataclass(frozen=True)
class TaskSet:
    """One task set with every key resolved: `data` itself, or an entry of `data.mix` (null keys from `data`)."""
    key: str  # how errors name it: "data" or "data.mix[1]"
    id_prefix: str  # "" for data.path, "m1." for data.mix[1]
    path: str
    format: str
    weight: float
    epochs: int
    prompt_key: str
    answer_key: str
    prompt_template: str
    generated_tasks: int
    shuffle_seed: int | None


def task_sets(data: DataConfig) -> list[TaskSet]:
    """The run's task sets, in `data.mix` order (or the one set of `data.path`)."""
    if not data.mix:
        return [TaskSet(key="data", id_prefix="", path=data.path, format=data.format, weight=1.0, epochs=data.epochs,
                        prompt_key=data.prompt_key, answer_key=data.answer_key, prompt_template=data.prompt_template,
                        generated_tasks=data.generated_tasks, shuffle_seed=data.shuffle_seed)]

    def pick(value: Any, default: Any) -> Any:
        return default if value is None else value

    return [TaskSet(key=f"data.mix[{i}]", id_prefix=f"m{i}.", path=m.path, format=pick(m.format, data.format),
                    weight=m.weight, epochs=pick(m.epochs, data.epochs), prompt_key=pick(m.prompt_key, data.prompt_key),
                    answer_key=pick(m.answer_key, data.answer_key),
                    prompt_template=pick(m.prompt_template, data.prompt_template),
                    generated_tasks=pick(m.generated_tasks, data.generated_tasks), shuffle_seed=data.shuffle_seed)
            for i, m in enumerate(data.mix)]


def _task_set(data: DataConfig | TaskSet) -> TaskSet:
    return data if isinstance(data, TaskSet) else task_sets(data)[0]


def load_rows(data: DataConfig | TaskSet) -> list[dict[str, Any]]:
    """A task set's rows as plain dicts (JSON-compatible values); a DataConfig means its first task set."""
    data = _task_set(data)
    if data.format == "generated":
        from rft.workflows.toy_tasks import generate_rows
        try:
            return generate_rows(data.path, data.generated_tasks, seed=data.shuffle_seed or 0)
        except ValueError as e:
            raise DatasetError(f"{data.key}.path: {e}") from None
    path = Path(data.path.split(":")[0] if data.format == "hf_disk" else data.path)
    if not data.path or not path.exists():
        raise DatasetError(f"{data.key}.path: dataset {data.path!r} does not exist")
    if data.format == "hf_disk":
        rows = _hf_disk_rows(data.path, data.key)
    else:
        rows = {"jsonl": _jsonl_rows, "parquet": _parquet_rows}[data.format](data.path)
    if not rows:
        raise DatasetError(f"{data.key}.path: dataset {data.path} has no rows")
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


def _hf_disk_rows(spec: str, key: str) -> list[dict[str, Any]]:
    from datasets import DatasetDict, load_from_disk

    path, _, split = spec.partition(":")
    dataset = load_from_disk(path)
    if isinstance(dataset, DatasetDict):
        if not split:
            raise DatasetError(f"{key}.path: {path} holds splits {list(dataset)}; name one as {path}:SPLIT")
        if split not in dataset:
            raise DatasetError(f"{key}.path: {path} has no split {split!r} (splits: {list(dataset)})")
        dataset = dataset[split]
    return dataset.to_list()


def task_id_for(index: int, prompt: str, answer: Any, prefix: str = "") -> str:
    digest = hashlib.sha1(json.dumps([prompt, answer], sort_keys=True, default=str).encode()).hexdigest()[:8]
    return f"{prefix}r{index:07d}-{digest}"


def rows_to_tasks(rows: list[dict[str, Any]], cfg: Config, task_set: TaskSet | None = None) -> list[TaskRecord]:
    """Epoch 0's tasks of one task set (default: the first), in dataset order (validates every row)."""
    data = task_set or task_sets(cfg.data)[0]
    tasks = []
    for index, row in enumerate(rows):
        where = f"{data.path} row {index}"
        if data.prompt_key not in row:
            raise DatasetError(f"{where}: no field {data.prompt_key!r} ({data.key}.prompt_key); fields: {sorted(row)}")
        if data.answer_key and data.answer_key not in row:
            raise DatasetError(f"{where}: no field {data.answer_key!r} ({data.key}.answer_key); fields: {sorted(row)}")
        fields = {**row, "prompt": row[data.prompt_key]}
        try:
            prompt = data.prompt_template.format(**fields)
        except (KeyError, IndexError, ValueError) as e:
            raise DatasetError(f"{where}: {data.key}.prompt_template {data.prompt_template!r} does not format: "
                               f"{type(e).__name__}: {e}") from None
        answer = row[data.answer_key] if data.answer_key else None
        metadata = {k: v for k, v in row.items() if k not in (data.prompt_key, data.answer_key)}
        tasks.append(TaskRecord(run_id=cfg.run.name, task_id=task_id_for(index, prompt, answer, data.id_prefix),
                                epoch=0, prompt=prompt, answer=answer, metadata=metadata))
    return tasks


def load_task_sets(cfg: Config) -> list[tuple[TaskSet, list[TaskRecord]]]:
    """Every task set with its epoch-0 tasks (every row of every set validated)."""
    return [(s, rows_to_tasks(load_rows(s), cfg, s)) for s in task_sets(cfg.data)]


def build_picker(cfg: Config) -> TaskPicker:
    """The picker over every configured task set (loads and validates every row)."""
    sets = [SetProgress(index=i, tasks=tasks, epochs=s.epochs, weight=s.weight)
            for i, (s, tasks) in enumerate(load_task_sets(cfg))]
    return TaskPicker(sets, build_selector(cfg.data))


def publish_tasks(cfg: Config, *, bootstrap: str | None = None, progress: bool | None = None) -> int:
    """Publish the selector's whole sequence to `cfg.topic("tasks")` (created if missing); returns how many.
    For selectors that need no rewards (an online selector would see none: use rft/explorer/publisher.py)."""
    from tqdm import tqdm

    from rft.transport import connect

    bootstrap = bootstrap or cfg.kafka.bootstrap_servers
    picker = build_picker(cfg)
    topic = ensure_tasks_topic(cfg, bootstrap)
    total = picker.remaining
    show = cfg.monitor.progress if progress is None else progress
    sink = connect(cfg.kafka, bootstrap).sink(client_id=f"{cfg.run.name}-publisher")
    try:
        futures = []
        for task in tqdm(picker.drain(), total=total, desc=f"publish {topic}", unit="task",
                         disable=not show or total < 1000):
            futures.append(sink.send_record(topic, task, key=task.task_id))
        sink.flush()
        for future in futures:
            future.get(timeout=cfg.kafka.request_timeout_ms / 1000)
    finally:
        sink.close()
    return total


def ensure_tasks_topic(cfg: Config, bootstrap: str) -> str:
    from rft.transport import connect

    topic = cfg.topic("tasks")
    admin = connect(cfg.kafka, bootstrap).admin()
    try:
        admin.create_topics([topic])
    finally:
        admin.close()
    return topic


def main(argv: list[str]) -> int:
    from rft.commandline import add_config_arguments, config_from_args

    parser = argparse.ArgumentParser(prog="rft publish", description="Publish a dataset's tasks to the run's "
                                     "tasks topic: at once, or online for a selector that reads rewards "
                                     "(curriculum) until the sequence ends or SIGTERM.")
    add_config_arguments(parser)
    cfg = config_from_args(parser.parse_args(argv))
    if cfg.kafka.bootstrap_servers == "embedded":
        print("rft publish: kafka.bootstrap_servers is 'embedded'; publishing needs the run's broker address "
              "(--set kafka.bootstrap_servers=HOST:PORT)", file=sys.stderr)
        return 2
    from rft.run_topics import create_run_topics

    try:
        create_run_topics(cfg)  # a trainer or explorers started separately find every topic of the run
        if selector_needs_rewards(cfg.data):
            from rft.explorer.publisher import serve
            count = serve(cfg)
        else:
            count = publish_tasks(cfg)
    except DatasetError as e:
        print(f"rft publish: {e}", file=sys.stderr)
        return 2
    print(f"published {count} tasks to {cfg.topic('tasks')}")
    return 0
