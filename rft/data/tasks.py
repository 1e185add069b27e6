"""Task sets: a local dataset -> TaskRecords; publishing a selector's whole sequence (`rft publish`).

Sources (`format`): `jsonl`, `parquet`, `hf_disk` (`save_to_disk`; a DatasetDict as `path:split`), `generated` (a toy
or environment task named by `path`: rft.data.toy_tasks), `reasoning_gym` (rft/data/gym_tasks.py), `gsm8k` (JSONL
with `question` and an `answer` ending `#### N`: the answer is N, the solution kept as `solution` metadata),
`verifiers` (a verifiers taskset, read by verifiers in its own venv: rft/data/verifiers_tasks.py), and the
image sources `easy_vqa` (rft/data/easy_vqa.py) and `reasoning_gym_image` (rft/data/gym_images.py), whose rows carry
their images (`images`, a list of `rft.schema.Image`) into `TaskRecord.images`.
`generated` and `reasoning_gym` draw from the set's seed (`data.mix[i].seed`, else `data.shuffle_seed`;
`eval.sets[i].seed`); their rows and gsm8k's have fixed `prompt` / `answer` fields (`prompt_template` still applies).
A run has one task set (`data.path`) or several mixed by weight (`data.mix`, rft/data/selectors.py).

Each row becomes one TaskRecord:
- `task_id`: `r<row index>-<8 hex of sha1(prompt, answer)>` (`m<set>.r...` in a mix): stable across epochs and
  re-publishes of the same file, distinct for duplicate rows;
- `epoch`: how many times the task was published before, so `(task_id, epoch)` names one group;
- `prompt`: `prompt_template` formatted with the row's fields (`{prompt}` is the `prompt_key` field);
- `answer`: the `answer_key` field (`""`: none); `metadata`: the row's other fields; `images`: an image source's.
A row that lacks a key or does not format, or whose images are over the set's limits (`data.max_images`,
`data.max_image_bytes`, `data.max_image_pixels`), is an error naming row and key, before anything is sent: a task is
refused whole, never cut.
Publishing: a selector that reads no rewards (`sequential`, `shuffle`) has its whole sequence published at once
(`publish_tasks` returns after the broker acknowledged every record); one that does (`curriculum`) runs online in
the task publisher (rft/explorer/publisher.py), `data.tasks_ahead` tasks ahead of the explorers.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tqdm import tqdm

from rft.data import easy_vqa
from rft.data.config import DataConfig
from rft.data.gym_images import gym_image_rows
from rft.data.gym_tasks import METADATA_KEY, GymError, gym_rows
from rft.data.selectors import SetProgress, TaskPicker, build_selector
from rft.data.toy_tasks import TOY_TASKS, generate_rows
from rft.data.verifiers_tasks import VerifiersError, host_from_options, verifiers_rows
from rft.schema import ImageLimits, TaskRecord, decode_task
from rft.transport import connect
from rft.transport.config import KafkaConfig
from rft.transport.run_topics import RunTopics


class DatasetError(ValueError):
    pass


DEFAULT_IMAGE_LIMITS = ImageLimits.of(DataConfig())  # data.max_images, ... left at their defaults


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
    seed: int  # generated / reasoning_gym: the generator's seed
    options: dict[str, Any]  # reasoning_gym: the dataset's own options; generated: the toy task's options
    images: ImageLimits = DEFAULT_IMAGE_LIMITS  # the images a task may carry (data.max_images, ...)


def task_sets(data: DataConfig) -> list[TaskSet]:
    """The run's task sets, in `data.mix` order (or the one set of `data.path`)."""
    if not data.mix:
        return [TaskSet(key="data", id_prefix="", path=data.path, format=data.format, weight=1.0, epochs=data.epochs,
                        prompt_key=data.prompt_key, answer_key=data.answer_key, prompt_template=data.prompt_template,
                        generated_tasks=data.generated_tasks, seed=data.shuffle_seed or 0, options=data.options,
                        images=ImageLimits.of(data))]

    def pick(value: Any, default: Any) -> Any:
        return default if value is None else value

    return [TaskSet(key=f"data.mix[{i}]", id_prefix=f"m{i}.", path=m.path, format=pick(m.format, data.format),
                    weight=m.weight, epochs=pick(m.epochs, data.epochs), prompt_key=pick(m.prompt_key, data.prompt_key),
                    answer_key=pick(m.answer_key, data.answer_key),
                    prompt_template=pick(m.prompt_template, data.prompt_template),
                    generated_tasks=pick(m.generated_tasks, data.generated_tasks),
                    seed=pick(m.seed, data.shuffle_seed or 0), options=pick(m.options, data.options),
                    images=ImageLimits.of(data))
            for i, m in enumerate(data.mix)]


def _task_set(data: DataConfig | TaskSet) -> TaskSet:
    return data if isinstance(data, TaskSet) else task_sets(data)[0]


def load_rows(data: DataConfig | TaskSet) -> list[dict[str, Any]]:
    """A task set's rows as plain dicts (JSON-compatible values); a DataConfig means its first task set."""
    data = _task_set(data)
    if data.format == "generated":
        try:
            return generate_rows(data.path, data.generated_tasks, seed=data.seed, options=data.options)
        except ValueError as e:
            raise DatasetError(f"{data.key}.{'options' if data.path in TOY_TASKS else 'path'}: {e}") from None
    if data.format in ("reasoning_gym", "reasoning_gym_image"):
        rows_of = gym_rows if data.format == "reasoning_gym" else gym_image_rows
        try:
            return rows_of(data.path, data.options, seed=data.seed, size=data.generated_tasks)
        except GymError as e:
            raise DatasetError(f"{data.key}.{e.key}: {e}") from None
    if data.format == "verifiers":
        try:
            return verifiers_rows(host_from_options(data.path, data.options), limit=data.generated_tasks)
        except VerifiersError as e:
            raise DatasetError(f"{data.key}.{e.key}: {e}") from None
    if data.format == "easy_vqa":
        try:
            return easy_vqa.easy_vqa_rows(data.path, seed=data.seed, size=data.generated_tasks)
        except easy_vqa.EasyVqaError as e:
            raise DatasetError(f"{data.key}.path: {e}") from None
    path = Path(data.path.split(":")[0] if data.format == "hf_disk" else data.path)
    if not data.path or not path.exists():
        raise DatasetError(f"{data.key}.path: dataset {data.path!r} does not exist")
    if data.format == "hf_disk":
        rows = _hf_disk_rows(data.path, data.key)
    else:
        rows = {"jsonl": _jsonl_rows, "parquet": _parquet_rows, "gsm8k": _gsm8k_rows}[data.format](data.path)
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


def _gsm8k_rows(path: str) -> list[dict[str, Any]]:
    """GSM8K-style rows: `question` -> prompt, the number after the last `####` of `answer` -> answer (thousands
    separators dropped), the whole worked answer -> solution."""
    rows = []
    for n, row in enumerate(_jsonl_rows(path)):
        question, solution = row.get("question"), row.get("answer")
        if not isinstance(question, str) or not isinstance(solution, str):
            raise DatasetError(f"{path} row {n}: a gsm8k row needs string fields 'question' and 'answer'; "
                               f"fields: {sorted(row)}")
        if "####" not in solution:
            raise DatasetError(f"{path} row {n}: the answer does not end with '#### N' (the final answer)")
        final = solution.rsplit("####", 1)[1].strip().replace(",", "")
        if not final:
            raise DatasetError(f"{path} row {n}: nothing follows '####' in the answer")
        rows.append({**{k: v for k, v in row.items() if k not in ("question", "answer")},
                     "prompt": question, "answer": final, "solution": solution})
    return rows


def _parquet_rows(path: str) -> list[dict[str, Any]]:
    import pyarrow.parquet as pq  # heavy: pyarrow, only for parquet task sets
    return pq.read_table(path).to_pylist()


def _hf_disk_rows(spec: str, key: str) -> list[dict[str, Any]]:
    from datasets import DatasetDict, load_from_disk  # heavy: datasets (pyarrow), only for hf_disk task sets

    path, _, split = spec.partition(":")
    dataset = load_from_disk(path)
    if isinstance(dataset, DatasetDict):
        if not split:
            raise DatasetError(f"{key}.path: {path} holds splits {list(dataset)}; name one as {path}:SPLIT")
        if split not in dataset:
            raise DatasetError(f"{key}.path: {path} has no split {split!r} (splits: {list(dataset)})")
        dataset = dataset[split]
    return dataset.to_list()


# their rows have `prompt` and `answer` whatever the keys say
FIXED_KEY_FORMATS = ("reasoning_gym", "gsm8k", "verifiers", "easy_vqa", "reasoning_gym_image")
IMAGE_FORMATS = ("easy_vqa", "reasoning_gym_image")  # their rows carry `images`
# the metadata field that names a generated row's entry (hashed into its task id)
IDENTITY_KEYS = {"reasoning_gym": METADATA_KEY, "reasoning_gym_image": METADATA_KEY, "easy_vqa": easy_vqa.METADATA_KEY,
                 "verifiers": "verifiers"}


def task_id_for(index: int, prompt: str, answer: Any, prefix: str = "", identity: Any = None) -> str:
    """`<prefix>r<index>-<hash>`; the hash covers the prompt, the answer and `identity` when given."""
    content = [prompt, answer] if identity is None else [prompt, answer, identity]
    digest = hashlib.sha1(json.dumps(content, sort_keys=True, default=str).encode()).hexdigest()[:8]
    return f"{prefix}r{index:07d}-{digest}"


def rows_to_tasks(rows: list[dict[str, Any]], data: DataConfig | TaskSet, *, run_id: str) -> list[TaskRecord]:
    """Epoch 0's tasks of one task set (a DataConfig means its first), in dataset order (validates every row);
    `run_id` is the run's name."""
    data = _task_set(data)
    prompt_key, answer_key = ("prompt", "answer") if data.format in FIXED_KEY_FORMATS else (data.prompt_key,
                                                                                             data.answer_key)
    tasks = []
    for index, row in enumerate(rows):
        where = f"{data.path} row {index}"
        if prompt_key not in row:
            raise DatasetError(f"{where}: no field {prompt_key!r} ({data.key}.prompt_key); fields: {sorted(row)}")
        if answer_key and answer_key not in row:
            raise DatasetError(f"{where}: no field {answer_key!r} ({data.key}.answer_key); fields: {sorted(row)}")
        fields = {**row, "prompt": row[prompt_key]}
        try:
            prompt = data.prompt_template.format(**fields)
        except (KeyError, IndexError, ValueError) as e:
            raise DatasetError(f"{where}: {data.key}.prompt_template {data.prompt_template!r} does not format: "
                               f"{type(e).__name__}: {e}") from None
        answer = row[answer_key] if answer_key else None
        images = row["images"] if data.format in IMAGE_FORMATS else []
        if problem := data.images.problem(images):
            raise DatasetError(f"{where}: the task is refused: {problem}")
        metadata = {k: v for k, v in row.items() if k not in (prompt_key, answer_key)
                    and not (k == "images" and data.format in IMAGE_FORMATS)}
        identity = metadata.get(IDENTITY_KEYS[data.format]) if data.format in IDENTITY_KEYS else None
        task_id = task_id_for(index, prompt, answer, data.id_prefix, identity=identity)
        tasks.append(TaskRecord(run_id=run_id, task_id=task_id, epoch=0, prompt=prompt, answer=answer,
                                metadata=metadata, images=images))
    return tasks


def load_task_sets(data: DataConfig, *, run_id: str) -> list[tuple[TaskSet, list[TaskRecord]]]:
    """Every task set with its epoch-0 tasks (every row of every set validated)."""
    return [(s, rows_to_tasks(load_rows(s), s, run_id=run_id)) for s in task_sets(data)]


def build_picker(data: DataConfig, *, run_id: str) -> TaskPicker:
    """The picker over every configured task set (loads and validates every row)."""
    sets = [SetProgress(index=i, tasks=tasks, epochs=s.epochs, weight=s.weight)
            for i, (s, tasks) in enumerate(load_task_sets(data, run_id=run_id))]
    return TaskPicker(sets, build_selector(data))


def publish_tasks(data: DataConfig, topics: RunTopics, kafka: KafkaConfig, *, bootstrap: str | None = None,
                  progress: bool = False, skip: frozenset[str] | set[str] = frozenset()) -> int:
    """Publish the selector's whole sequence to `topics.tasks` (created if missing), in order, less the tasks whose
    group ids are in `skip` (those a publish cut short wrote already: `published_groups`); returns how many were sent,
    once the broker acknowledged every one. For selectors that need no rewards (an online selector would see none: use
    rft/explorer/publisher.py). `progress`: a progress bar for 1000 tasks or more."""
    bootstrap = bootstrap or kafka.bootstrap_servers
    picker = build_picker(data, run_id=topics.run)
    topic = ensure_tasks_topic(topics, kafka, bootstrap)
    total = picker.remaining
    sink = connect(kafka, bootstrap).sink(client_id=f"{topics.run}-publisher")
    try:
        futures = []
        for task in tqdm(picker.drain(), total=total, desc=f"publish {topic}", unit="task",
                         disable=not progress or total < 1000):
            if task.group_id not in skip:
                futures.append(sink.send_record(topic, task, key=task.task_id))
        sink.flush()
        for future in futures:
            future.get(timeout=kafka.request_timeout_ms / 1000)
    finally:
        sink.close()
    return len(futures)


def published_groups(topics: RunTopics, kafka: KafkaConfig, *, bootstrap: str | None = None) -> set[str]:
    """The group ids of every task on `topics.tasks` (read from the beginning, without a consumer group)."""
    source = connect(kafka, bootstrap or kafka.bootstrap_servers).source()
    try:
        begin, end = source.beginning_offsets(topics.tasks), source.end_offsets(topics.tasks)
        return {decode_task(m.value, m.headers).group_id for m in source.read_offsets(begin, end)}
    finally:
        source.close()


def ensure_tasks_topic(topics: RunTopics, kafka: KafkaConfig, bootstrap: str) -> str:
    """Create the run's tasks topic (kafka.partitions) where missing; returns its name."""
    admin = connect(kafka, bootstrap).admin()
    try:
        admin.create_topics([topics.tasks])
    finally:
        admin.close()
    return topics.tasks
