"""easy-VQA task sets (`data.format: easy_vqa`): visual questions with exact answers, read from the easy-vqa 1.0
wheel (PyPI, MIT; 5,000 64 x 64 PNG images of one coloured shape each, 48,248 questions, 13 answers) without
installing it (it installs a top-level package named `test`). `make` downloads it to WHEEL (`pip download
easy-vqa==1.0 --no-deps`); a file whose SHA-256 is not WHEEL_SHA256 is refused.

`data.path` is `<wheel>:<split>`, the split `train` (4,000 images, 38,575 questions) or `test` (1,000 other images,
9,673 questions): the dataset's own split, so a held-out set shares no image with the training set. A set is
`generated_tasks` questions of the split (all of them when it has fewer), drawn by the set's seed and kept in the
dataset's order. Row: `prompt` the question (`what is the blue shape?`), `answer` its exact answer (one of 13:
`circle`, `yes`, `red`, ...; the `exact_match` reward), `choices` the 13 answers as `a, b, ...` for
`prompt_template`, `images` the question's image, and `easy_vqa` {split, question, image} naming the question and
its image (task ids hash it).
"""
from __future__ import annotations

import functools
import hashlib
import json
import random
import zipfile
from pathlib import Path
from typing import Any

from rft.schema import Image

WHEEL = ".cache/wheels/easy_vqa-1.0-py3-none-any.whl"
WHEEL_SHA256 = "fcb51b309b78c7b00f97b64cdbcbcf5c105f94da1b39c0796cee5a787c4f650f"
SPLITS = ("train", "test")
METADATA_KEY = "easy_vqa"
_DATA = "easy_vqa/data"


class EasyVqaError(ValueError):
    """The wheel is missing or not easy-vqa 1.0's, or the split is not one of SPLITS."""


def parse_path(path: str) -> tuple[str, str]:
    """`<wheel>:<split>` -> (wheel, split); a bare split means the wheel at WHEEL."""
    wheel, _, split = path.rpartition(":")
    if split not in SPLITS:
        raise EasyVqaError(f"{path!r}: name the split as <wheel>:{'|'.join(SPLITS)} (the dataset's own split), "
                           f"e.g. {WHEEL}:train")
    return wheel or WHEEL, split


@functools.lru_cache(maxsize=2)
def _questions(wheel: str, split: str) -> tuple[tuple[str, str, int], ...]:
    """The split's questions as (question, answer, image id), read from the checked wheel."""
    path = Path(wheel)
    if not path.is_file():
        raise EasyVqaError(f"{wheel}: no easy-vqa wheel here; `make` downloads it (pip download easy-vqa==1.0 "
                           f"--no-deps --dest {Path(WHEEL).parent})")
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    if digest != WHEEL_SHA256:
        raise EasyVqaError(f"{wheel}: SHA-256 {digest} is not that of the easy-vqa 1.0 wheel ({WHEEL_SHA256})")
    with zipfile.ZipFile(path) as archive:
        rows = json.loads(archive.read(f"{_DATA}/{split}/questions.json"))
    return tuple((str(q), str(a), int(i)) for q, a, i in rows)


@functools.lru_cache(maxsize=1)
def answers(wheel: str = WHEEL) -> tuple[str, ...]:
    """The 13 answers, in the dataset's order."""
    _questions(wheel, "test")  # checks the wheel
    with zipfile.ZipFile(wheel) as archive:
        return tuple(a.strip() for a in archive.read(f"{_DATA}/answers.txt").decode().splitlines() if a.strip())


def easy_vqa_rows(path: str, *, seed: int, size: int) -> list[dict[str, Any]]:
    """`size` questions of the split `path` names (all when it has fewer), drawn by `seed`, in the dataset's order."""
    wheel, split = parse_path(path)
    questions = _questions(wheel, split)
    picked = sorted(random.Random(seed).sample(range(len(questions)), min(size, len(questions))))
    choices = ", ".join(answers(wheel))
    images: dict[int, Image] = {}
    with zipfile.ZipFile(wheel) as archive:
        for index in picked:
            image_id = questions[index][2]
            if image_id not in images:
                images[image_id] = Image.of(archive.read(f"{_DATA}/{split}/images/{image_id}.png"), "image/png")
    return [{"prompt": question, "answer": answer, "choices": choices, "images": [images[image_id]],
             METADATA_KEY: {"split": split, "question": index, "image": image_id}}
            for index in picked for question, answer, image_id in [questions[index]]]
