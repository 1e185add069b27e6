"""The `data` section: the task set (or a weighted mix of sets), how its rows become prompts, and how tasks are
selected."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from rft.config import COUNT, FINITE, OPTIONAL, POSITIVE, SEED, Range, Section, SectionError, at_least, option, section
from rft.schema import MAX_IMAGE_BYTES, MAX_IMAGE_PIXELS, MAX_IMAGES

DataFormat = Literal["jsonl", "parquet", "hf_disk", "generated", "reasoning_gym", "gsm8k", "verifiers", "easy_vqa",
                     "reasoning_gym_image"]


@dataclass(frozen=True)
class TaskSetConfig(Section):
    """One entry of `data.mix`; a key left null takes the value of the `data.` key of the same name."""
    KEY = "data.mix[]"
    path: str = option("", help="required: the set's dataset (the toy task for format generated)")
    weight: float = option(1.0, help="relative share of the picks while the set has tasks left", range=POSITIVE)
    format: DataFormat | None = option(None, help="null: data.format")
    epochs: int | None = option(None, help="visits per task; null: data.epochs", range=COUNT)
    prompt_key: str | None = option(None, help="null: data.prompt_key")
    answer_key: str | None = option(None, help="null: data.answer_key")
    prompt_template: str | None = option(None, help="null: data.prompt_template")
    generated_tasks: int | None = option(None, help="null: data.generated_tasks", range=COUNT)
    seed: int | None = option(None, range=SEED,
        help="generated / reasoning_gym: the generator's seed; null: data.shuffle_seed")
    options: dict[str, Any] | None = option(None,
        help="reasoning_gym / generated: the dataset's options; null: data.options")

    def validate(self) -> None:
        if not self.path:
            raise SectionError("path", "required: the task set's dataset (or toy task for format generated)")


@dataclass(frozen=True)
class CurriculumConfig(Section):
    """`data.selector: curriculum`: prefer tasks whose mean reward so far is closest to `target`."""
    KEY = "data.curriculum"
    target: float = option(0.5, help="the mean reward of the tasks preferred", range=FINITE)
    prior: float = option(0.5, help="the mean reward assumed for a task without recorded rewards", range=FINITE)
    temperature: float = option(0.1, range=at_least(0, "0: always the closest"),
        help="pick weight exp(-abs(mean - target) / temperature); 0: always the closest")


@dataclass(frozen=True)
class DataConfig(Section):
    KEY = "data"
    path: str = option("",
        help="the task set: a .jsonl or .parquet file, an HF dataset directory (path:split for a DatasetDict), a "
        "toy task (format generated) or a reasoning-gym dataset; empty with data.mix")
    format: DataFormat = option("jsonl",
        help="how data.path is read: jsonl, parquet, hf_disk (save_to_disk), generated (rft/data/toy_tasks.py), "
        "reasoning_gym, gsm8k (question, answer ending `#### N`), verifiers (a verifiers taskset: "
        "rft/data/verifiers_tasks.py), and image tasks: easy_vqa (WHEEL:train|test), reasoning_gym_image (grids "
        "drawn as images; docs/data.md)")
    prompt_key: str = option("prompt",
        help="the row field holding the prompt ({prompt} in prompt_template); not for reasoning_gym and gsm8k rows")
    answer_key: str = option("answer",
        help="the row field holding the ground truth the reward compares with (\"\": none); not for reasoning_gym "
        "and gsm8k rows")
    prompt_template: str = option("{prompt}",
        help="a task's prompt: this string formatted with the row's fields, {prompt} being the prompt_key field")
    epochs: int = option(1, range=COUNT,
        help="times each task is published (its visits; selectors pick among tasks with visits left)")
    shuffle_seed: int | None = option(0, range=SEED,
        help="seeds every selector (shuffle: null keeps the dataset order)")
    selector: str = option("shuffle", help="sequential, shuffle, curriculum, or package.module:factory (docs/data.md)")
    generated_tasks: int = option(1000, range=COUNT,
        help="format generated / reasoning_gym / reasoning_gym_image / verifiers: how many tasks data.path generates "
        "(verifiers: reads at most); easy_vqa: at most this many of the split's questions")
    options: dict[str, Any] = option(factory=dict,
        help="reasoning_gym / generated / verifiers: the dataset's options (docs/data.md)")
    mix: list[TaskSetConfig] = option(factory=list, help="several task sets mixed by weight, instead of data.path")
    tasks_ahead: int = option(0, range=OPTIONAL,
        help="online selectors: tasks published ahead of the explorers; 0: 2 x replicas x tasks_per_batch")
    curriculum: CurriculumConfig = section(CurriculumConfig)
    max_images: int = option(8, range=Range(0, MAX_IMAGES, note="0: text tasks only"),
        help="images one task may show; a task with more is refused where it enters (docs/data.md, Image tasks)")
    max_image_bytes: int = option(4 << 20, range=Range(1, MAX_IMAGE_BYTES),
        help="encoded bytes of one image of a task; a larger one is refused with its task, never cut")
    max_image_pixels: int = option(2048 * 2048, range=Range(1, MAX_IMAGE_PIXELS),
        help="width x height one image of a task may declare (read from its header before it is decoded)")

    def validate(self) -> None:
        """Datasets are read only when publishing; `selector` is a registry name (rft.run.loading)."""
        if self.mix and self.path:
            raise SectionError("mix", f"set data.path or data.mix, not both (data.path is {self.path!r})")
