"""A new algorithm written in one file (_plugin_algorithm.py), named by import path, trained for two steps by the
real trainer (torchrun, 2 processes, data parallel 2, gloo, the tiny model; _worker_plugin_algorithm.py), with no
edit anywhere else: its keys are checked as a run's config loads, and the trainer provides every part it declares
in its `Needs` (reference, teacher, critic, demonstrations, step) and logs its `step_metrics`.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from rft.config import ConfigError
from rft.models.tiny import make_tiny_model
from rft.run.loading import run_config_from_dict

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _launch import run_worker_on  # noqa: E402
from _worker_plugin_algorithm import PLUGIN  # noqa: E402

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("plugin-model") / "qwen", seed=8)


@pytest.fixture(scope="module")
def metrics(model, tmp_path_factory) -> list[dict]:
    out = run_worker_on("_worker_plugin_algorithm.py", tmp_path_factory.mktemp("plugin-results"), {"qwen": model})
    return [json.loads(line) for line in (out / "run" / "metrics.jsonl").read_text().splitlines()]


def test_its_keys_are_checked_when_the_config_loads(model):
    def load(**options):
        return run_config_from_dict({"model": {"path": str(model)}, "algorithm": {"name": PLUGIN, **options}},
                                    "plugin.yaml")

    assert load(scale=3, teacher_path=str(model)).algorithm.options == {  # resolved: its defaults too
        "scale": 3.0, "teacher_path": str(model), "demonstrations_per_step": 1, "critic_lr": 1e-3}
    with pytest.raises(ConfigError, match=r"plugin.yaml: algorithm.scael: unknown key \(did you mean 'scale'"):
        load(scael=3)
    with pytest.raises(ConfigError, match=r"plugin.yaml: algorithm.scale: must be > 0, got -1"):
        load(scale=-1)
    with pytest.raises(ConfigError, match=r"plugin.yaml: algorithm.kl_coef: unknown key"):  # another algorithm's key
        load(kl_coef=0.1)


def test_the_trainer_provides_what_it_declares_for_two_steps(metrics):
    step1, step2 = [m for m in metrics if "plugin_step" in m]
    for step, m in ((1, step1), (2, step2)):
        assert m["step"] == step and m["plugin_step"] == pytest.approx(step)  # `step` in every micro-batch
        assert m["demonstrations"] == 1 and m["plugin_demo_rows"] == 1.0  # one demonstration row a step
        assert m["plugin_scale"] == 2.0 * step  # its step_metrics, with its option scale: 2
        assert m["value_loss"] > 0 and m["critic_grad_norm"] > 0  # the critic trained on its targets
        assert m["loss"] != 0 and m["step_skipped"] == 0.0
    # the reference and the teacher are the initial weights: equal to the policy at step 1, not after it moved
    assert step1["plugin_ref_gap"] == pytest.approx(0, abs=1e-5) and step1["plugin_teacher_gap"] == pytest.approx(
        0, abs=1e-5)
    assert step2["plugin_ref_gap"] > 1e-4 and step2["plugin_teacher_gap"] == pytest.approx(step2["plugin_ref_gap"])
