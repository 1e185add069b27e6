"""Task selection without a broker: `data.mix` / `data.selector` config errors name the key, the shuffle selector of
a mix shuffles each set with its own seed, an import-path selector is used and checked."""
from __future__ import annotations

import json
import random

import pytest

from rft.config import ConfigError
from rft.data.selectors import SelectionError, epoch_order
from rft.data.tasks import build_picker
from rft.run.loading import run_config_from_dict


def cfg_for(data):
    return run_config_from_dict({"run": {"name": "demo"}, "model": {"path": "m"}, "data": data})


def picker_for(data):
    cfg = cfg_for(data)
    return build_picker(cfg.data, run_id=cfg.run.name)


def write_rows(path, n):
    path.write_text("".join(json.dumps({"prompt": f"p{i}", "answer": str(i)}) + "\n" for i in range(n)))
    return str(path)


@pytest.mark.parametrize("data,message", [
    ({"path": "a.jsonl", "mix": [{"path": "b.jsonl"}]}, r"data.mix: set data.path or data.mix, not both"),
    ({"mix": [{"path": "a.jsonl"}, {"path": "b.jsonl", "weight": -1}]}, r"data.mix\[1\].weight: must be > 0"),
    ({"mix": [{"weight": 2}]}, r"data.mix\[0\].path: required"),
    ({"mix": [{"path": "a", "epochs": 0}]}, r"data.mix\[0\].epochs: must be >= 1"),
    ({"mix": [{"path": "a", "format": "csv"}]}, r"data.mix\[0\].format: must be one of"),
    ({"selector": "curiculum"}, r"data.selector: unknown name 'curiculum' \(did you mean 'curriculum'"),
    ({"selector": "curriculum", "shuffle_seed": None}, r"data.shuffle_seed: the curriculum selector needs a seed"),
    ({"curriculum": {"temperature": -0.1}}, r"data.curriculum.temperature: must be >= 0"),
    ({"curriculum": {"targt": 0.4}}, r"data.curriculum.targt: unknown key \(did you mean 'target'"),
    ({"tasks_ahead": -1}, r"data.tasks_ahead: must be >= 0"),
])
def test_data_config_errors_name_the_key(data, message):
    with pytest.raises(ConfigError, match="<dict>: " + message):
        cfg_for(data)


def test_shuffled_mix_orders_each_set_with_its_own_seed(tmp_path):
    a, b = write_rows(tmp_path / "a.jsonl", 5), write_rows(tmp_path / "b.jsonl", 5)
    picker = picker_for({"shuffle_seed": 4, "epochs": 2, "mix": [{"path": a}, {"path": b}]})
    tasks = list(picker.drain())
    assert len(tasks) == 20 and picker.remaining == 0
    for index in (0, 1):
        base = [t.task_id for t in picker.sets[index].tasks]
        got = [(t.task_id, t.epoch) for t in tasks if t.task_id.startswith(f"m{index}.")]
        expected = []
        for epoch in range(2):
            order = list(range(5))
            random.Random(4 + epoch + 1_000_003 * index).shuffle(order)
            expected += [(base[i], epoch) for i in order]
        assert got == expected
    assert epoch_order(5, 0, 4) != epoch_order(5, 0, 4 + 1_000_003)  # the two sets are not in lockstep


class LastFirst:
    """A selector from an import path: each epoch in reverse dataset order."""
    needs_rewards = False

    def __init__(self, data):
        self.broken = data.prompt_template == "broken"

    def choose(self, progress, stats, pick):
        return 0 if self.broken else len(progress.tasks) - 1 - progress.picked % len(progress.tasks)


def test_import_path_selector_is_used_and_checked(tmp_path):
    path = write_rows(tmp_path / "a.jsonl", 3)
    picker = picker_for({"path": path, "selector": "tests.unit.test_selectors:LastFirst"})
    assert [t.prompt for t in picker.drain()] == ["p2", "p1", "p0"]
    broken = picker_for({"path": path, "epochs": 1, "prompt_template": "broken",
                         "selector": "tests.unit.test_selectors:LastFirst"})
    with pytest.raises(SelectionError, match="chose task 0 of set 0, which has no visits left"):
        list(broken.drain())
