"""Image task sets (docs/data.md, "Image tasks"): easy-VQA read from its wheel (rft/data/easy_vqa.py) and
reasoning-gym grids drawn as images (rft/data/gym_images.py). Their tasks are valid records within the run's image
limits, carry their images through the selectors, the same seed gives the same tasks (image bytes included), held-out
sets share nothing with training sets, the rewards score them, and a task over the limits is refused whole."""
from __future__ import annotations

import hashlib
import io
import json
import zipfile

import pytest
from PIL import Image as PILImage

from rft.config import ConfigError
from rft.data.easy_vqa import WHEEL, answers, easy_vqa_rows
from rft.data.gym_images import CELL, GRID_TASKS
from rft.data.tasks import DatasetError, build_picker, load_rows, load_task_sets, rows_to_tasks
from rft.evaluation.main import load_eval_sets
from rft.rewards import build_reward
from rft.run.loading import run_config_from_dict
from rft.schema import ImageLimits, decode_task, encode

pytestmark = pytest.mark.skipif(not zipfile.is_zipfile(WHEEL), reason=f"`make` downloads the easy-vqa wheel to {WHEEL}")


def cfg_for(data, **sections):
    return run_config_from_dict({"run": {"name": "vis"}, "model": {"path": "unused"}, "data": data, **sections})


def vqa(split="train", **extra):
    return {"format": "easy_vqa", "path": f"{WHEEL}:{split}", "generated_tasks": 12,
            "prompt_template": "{prompt} Answer with one of: {choices}.", **extra}


def grids(name, **extra):
    return {"format": "reasoning_gym_image", "path": name, "generated_tasks": 4, **extra}


def _checked(tasks, data):
    """Every task survives the wire, decoded within the run's limits."""
    limits = ImageLimits.of(data)
    for task in tasks:
        assert task.images and not limits.problem(task.images)
        assert decode_task(*encode(task), images=limits) == task
    return tasks


def test_easy_vqa_tasks_are_the_wheels_questions_with_their_images():
    cfg = cfg_for(vqa(shuffle_seed=5))
    tasks = _checked(rows_to_tasks(load_rows(cfg.data), cfg.data, run_id="vis"), cfg.data)
    assert len(tasks) == 12 and len(answers()) == 13 and all(t.answer in answers() for t in tasks)
    with zipfile.ZipFile(WHEEL) as archive:
        questions = json.loads(archive.read("easy_vqa/data/train/questions.json"))
        for task in tasks:
            spec = task.metadata["easy_vqa"]
            (image,) = task.images
            assert spec["split"] == "train" and questions[spec["question"]] == [
                task.prompt.split(" Answer with")[0], task.answer, spec["image"]]
            assert task.prompt.endswith(f"Answer with one of: {', '.join(answers())}.")
            assert image.data == archive.read(f"easy_vqa/data/train/images/{spec['image']}.png")
            assert image.media_type == "image/png" and PILImage.open(io.BytesIO(image.data)).size == (64, 64)
    again = rows_to_tasks(load_rows(cfg.data), cfg.data, run_id="vis")
    assert [(t.task_id, t.prompt, t.answer, t.images) for t in again] == [
        (t.task_id, t.prompt, t.answer, t.images) for t in tasks]
    other = cfg_for(vqa(shuffle_seed=6)).data
    assert {t.task_id for t in rows_to_tasks(load_rows(other), other, run_id="vis")} != {t.task_id for t in tasks}
    reward = build_reward(cfg.explorer)  # exact_match
    assert [r.score for r in reward.score([tasks[0].answer, " " + tasks[0].answer + "\n", "purple"], tasks[0])] == [
        1.0, 1.0, 0.0]


def test_easy_vqa_held_out_split_shares_no_image_or_question_with_training():
    with zipfile.ZipFile(WHEEL) as archive:
        train_images = {hashlib.sha256(archive.read(n)).hexdigest() for n in archive.namelist()
                        if n.startswith("easy_vqa/data/train/images/")}
    test_rows = easy_vqa_rows(f"{WHEEL}:test", seed=0, size=10 ** 6)  # the whole split
    assert len(train_images) == 4000 and len(test_rows) == 9673
    assert not {row["images"][0].sha256 for row in test_rows} & train_images
    cfg = cfg_for(vqa(), eval={"sets": [{"name": "held_out", **vqa("test")}]})
    held_out = load_eval_sets(cfg.eval, cfg.explorer, cfg.model, run_id="vis", seed=0)[0].tasks
    train = rows_to_tasks(load_rows(cfg.data), cfg.data, run_id="vis")
    assert len(held_out) == 12 and all(t.metadata["easy_vqa"]["split"] == "test" for t in held_out)
    assert not {i.sha256 for t in held_out for i in t.images} & {i.sha256 for t in train for i in t.images}


@pytest.mark.parametrize("name", sorted(GRID_TASKS))
def test_grid_tasks_are_drawn_the_same_for_a_seed_and_held_out_by_seed(name):
    cfg = cfg_for(grids(name, shuffle_seed=2), eval={"sets": [{"name": "held_out", **grids(name, seed=77)}]})
    tasks = _checked(rows_to_tasks(load_rows(cfg.data), cfg.data, run_id="vis"), cfg.data)
    again = rows_to_tasks(load_rows(cfg.data), cfg.data, run_id="vis")
    assert [(t.task_id, t.prompt, t.answer, t.images) for t in again] == [
        (t.task_id, t.prompt, t.answer, t.images) for t in tasks]
    for task in tasks:
        spec = task.metadata["reasoning_gym"]
        assert (spec["dataset"], spec["seed"]) == (name, 2) and "The image shows a" in task.prompt
        width, height = PILImage.open(io.BytesIO(task.images[0].data)).size
        assert (width - 1) % CELL == 0 and (height - 1) % CELL == 0 and min(width, height) > CELL
    held_out = load_eval_sets(cfg.eval, cfg.explorer, cfg.model, run_id="vis", seed=0)[0].tasks
    assert not {t.task_id for t in held_out} & {t.task_id for t in tasks}
    assert not {(t.images[0].sha256, str(t.answer)) for t in held_out} & {
        (t.images[0].sha256, str(t.answer)) for t in tasks}


@pytest.mark.parametrize("name, reward, reply", [
    ("maze", "reasoning_gym", "{answer}"),
    ("largest_island", "reasoning_gym", "The largest island has {answer} cells."),
    ("rotate_matrix", "reasoning_gym_tagged", "<answer>{answer}</answer>"),
    ("shortest_path", "reasoning_gym_tagged", "<answer>{answer}</answer>"),
])
def test_grid_tasks_are_scored_by_reasoning_gyms_own_score_answer(name, reward, reply):
    cfg = cfg_for(grids(name), explorer={"reward": reward})
    task = rows_to_tasks(load_rows(cfg.data), cfg.data, run_id="vis")[0]
    scores = build_reward(cfg.explorer).score([reply.format(answer=task.answer), "<answer>zzz</answer>"], task)
    assert [s.score for s in scores] == [1.0, 0.0]


def test_the_picker_carries_the_images_into_every_epoch():
    cfg = cfg_for(vqa(epochs=2, generated_tasks=3))
    (_, tasks), = load_task_sets(cfg.data, run_id="vis")
    picked = list(build_picker(cfg.data, run_id="vis").drain())
    assert len(picked) == 6 and {t.epoch for t in picked} == {0, 1}
    assert all(p.images == next(t.images for t in tasks if t.task_id == p.task_id) for p in picked)


def test_a_task_over_the_runs_image_limits_is_refused_whole():
    with pytest.raises(DatasetError, match=r"row 0: the task is refused: images\[0\]: \d+ bytes, over "
                                           r"data.max_image_bytes = 100 \(an image is refused whole, never cut\)"):
        cfg = cfg_for(vqa(max_image_bytes=100))
        rows_to_tasks(load_rows(cfg.data), cfg.data, run_id="vis")
    with pytest.raises(DatasetError, match=r"row 0: the task is refused: 1 images, over data.max_images = 0"):
        cfg = cfg_for(grids("maze", max_images=0))
        rows_to_tasks(load_rows(cfg.data), cfg.data, run_id="vis")
    with pytest.raises(DatasetError, match=r"x .* pixels, outside 1 .. data.max_image_pixels = 400"):
        build_picker(cfg_for(grids("maze", max_image_pixels=400)).data, run_id="vis")
    cfg = cfg_for({"path": "copy_char", "format": "generated", "max_images": 0},
                  eval={"sets": [{"name": "held_out", **grids("maze")}]})
    with pytest.raises(DatasetError, match=r"maze row 0: the task is refused: 1 images, over data.max_images = 0"):
        load_eval_sets(cfg.eval, cfg.explorer, cfg.model, run_id="vis", seed=0, images=ImageLimits.of(cfg.data))


def test_wheel_and_config_errors_name_the_key(tmp_path):
    fake = tmp_path / "easy_vqa-1.0-py3-none-any.whl"
    fake.write_bytes(b"PK\x05\x06" + b"\0" * 18)
    for path, message in ((f"{tmp_path}/none.whl:train", r"data.path: .*none.whl: no easy-vqa wheel here; `make`"),
                          (f"{fake}:test", r"data.path: .* is not that of the easy-vqa 1.0 wheel")):
        cfg = cfg_for({**vqa(), "path": path})
        with pytest.raises(DatasetError, match=message):
            load_rows(cfg.data)
    with pytest.raises(ConfigError, match=r"data.path: reasoning_gym_image draws the grids of .*'basic_arithmetic' is"):
        cfg_for(grids("basic_arithmetic"))
    with pytest.raises(ConfigError, match=r"data.options: .*no option 'sizee'"):
        cfg_for(grids("maze", options={"sizee": 3}))
    with pytest.raises(ConfigError, match=r"data.options: dataset options are for formats reasoning_gym, "):
        cfg_for(vqa(options={"x": 1}))
    with pytest.raises(ConfigError, match=r"data.format: reward 'reasoning_gym' scores reasoning_gym tasks"):
        cfg_for(vqa(), explorer={"reward": "reasoning_gym"})
    with pytest.raises(ConfigError, match=r"eval.sets\[0\].path: .* name the split as <wheel>:train\|test"):
        cfg_for(vqa(), eval={"sets": [{"name": "x", **vqa("validation")}]})
    with pytest.raises(ConfigError, match=r"data.path: 'train.whl': name the split as <wheel>:train\|test"):
        cfg_for({**vqa(), "path": "train.whl"})
    with pytest.raises(ConfigError, match=r"data.max_images: .*in \[0, 64\]"):
        cfg_for(vqa(max_images=65))
