"""The configs/ recipes: each validates against the shape of the model it names (heads, KV heads and layers from
the published config.json, so TP/PP divisibility is checked), and `rft run`'s GPU plan fits the hardware each
recipe's header promises."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from rft.cli.launcher import ROLES_BY_MODE
from rft.cli.planning import LaunchError, gpu_plan
from rft.run.loading import load_run_config

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
# From the models' published config.json files on the Hugging Face hub.
SHAPES = {"gsm8k-qwen2.5-1.5b.yaml": {"architectures": ["Qwen2ForCausalLM"], "num_attention_heads": 12,
                                     "num_key_value_heads": 2, "num_hidden_layers": 28},
          "gsm8k-7b.yaml": {"architectures": ["Qwen2ForCausalLM"], "num_attention_heads": 28,
                            "num_key_value_heads": 4, "num_hidden_layers": 28}}


def recipe(name: str, tmp_path: Path, monkeypatch):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(SHAPES[name]))
    monkeypatch.setenv("MODEL_DIR", str(model))
    return load_run_config(CONFIGS / name)


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_gpu_recipes_validate_against_their_models_shapes(name, tmp_path, monkeypatch):
    cfg = recipe(name, tmp_path, monkeypatch)
    t = cfg.trainer
    assert SHAPES[name]["num_key_value_heads"] % t.tensor_parallel == 0
    assert SHAPES[name]["num_hidden_layers"] % t.pipeline_parallel == 0


def test_a_recipe_whose_parallel_layout_does_not_fit_the_model_is_refused(tmp_path, monkeypatch):
    from rft.config import ConfigError

    SHAPES_BAD = dict(SHAPES["gsm8k-7b.yaml"], num_key_value_heads=2)
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(SHAPES_BAD))
    monkeypatch.setenv("MODEL_DIR", str(model))
    with pytest.raises(ConfigError, match="trainer.tensor_parallel: 4 does not divide the model's 2 key/value heads"):
        load_run_config(CONFIGS / "gsm8k-7b.yaml")


def test_the_1_5b_recipe_fits_one_8_gpu_node_with_disjoint_gpus(tmp_path, monkeypatch):
    cfg = recipe("gsm8k-qwen2.5-1.5b.yaml", tmp_path, monkeypatch)
    plan = gpu_plan(cfg, ROLES_BY_MODE[cfg.run.mode], [str(i) for i in range(8)])
    assert plan["trainer"] == "0,1"
    assert [plan[f"explorer-{i}"] for i in range(4)] == ["2", "3", "4", "5"] and plan["evaluator"] == "6"
    used = [g for gpus in plan.values() for g in gpus.split(",")]
    assert len(used) == len(set(used))


def test_the_gpu_plan_refuses_a_run_larger_than_the_machine_and_is_empty_on_cpu(tmp_path, monkeypatch):
    cfg = recipe("gsm8k-7b.yaml", tmp_path, monkeypatch)  # 8 trainer GPUs + 4 explorers x 2
    roles = ROLES_BY_MODE[cfg.run.mode]
    with pytest.raises(LaunchError, match="has 8 GPUs, the run needs 16"):
        gpu_plan(cfg, roles, [str(i) for i in range(8)])
    assert gpu_plan(cfg, roles, [str(i) for i in range(16)])["explorer-3"] == "14,15"
    assert gpu_plan(cfg, roles, []) == {}


def test_with_share_gpus_the_parts_share_the_machines_gpus_round_robin(tmp_path, monkeypatch):
    cfg = recipe("gsm8k-7b.yaml", tmp_path, monkeypatch)  # 8 trainer GPUs + 4 explorers x 2
    roles = ROLES_BY_MODE[cfg.run.mode]
    cfg = cfg.with_values({"run.share_gpus": True})
    plan = gpu_plan(cfg, roles, [str(i) for i in range(8)])
    assert plan["trainer"] == "0,1,2,3,4,5,6,7"
    assert [plan[f"explorer-{i}"] for i in range(4)] == ["0,1", "2,3", "4,5", "6,7"]
    with pytest.raises(LaunchError, match="has 4 GPUs"):  # the trainer alone needs 8: sharing cannot help
        gpu_plan(cfg, roles, [str(i) for i in range(4)])
    cfg = cfg.with_values({"run.share_gpus": False})
    with pytest.raises(LaunchError, match="run.share_gpus"):
        gpu_plan(cfg, roles, [str(i) for i in range(8)])
