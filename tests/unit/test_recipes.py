"""The configs/ recipes: each validates against the shape of the model it names (heads, KV heads, layers and experts
from the published config.json, so TP/PP/EP divisibility is checked), and `rft run`'s GPU plan fits the hardware each
recipe's header promises. The tiny Qwen3-MoE config passes `rft validate` against the model its Makefile target
writes, and the tiny VLM config against the one its target writes."""
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
                            "num_key_value_heads": 4, "num_hidden_layers": 28},
          "qwen3-30b-a3b-routing-replay.yaml": {"architectures": ["Qwen3MoeForCausalLM"], "num_attention_heads": 32,
                                                "num_key_value_heads": 4, "num_hidden_layers": 48, "num_experts": 128,
                                                "num_experts_per_tok": 8, "decoder_sparse_step": 1,
                                                "mlp_only_layers": [], "max_position_embeddings": 40960}}
REPO = CONFIGS.parent


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
    assert SHAPES[name].get("num_experts", 1) % t.expert_parallel == 0


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


def test_the_moe_recipe_replays_vllms_routing_of_16k_token_traces_on_two_nodes(tmp_path, monkeypatch):
    """Qwen3-30B-A3B: the trainer fills one 8-GPU node (TP 2 x PP 2 x DP 2, EP 2), eight one-GPU vLLM explorers the
    other; routing replay with unpacked 16k-token rows that fit the model's positions."""
    cfg = recipe("qwen3-30b-a3b-routing-replay.yaml", tmp_path, monkeypatch)
    shape, t = SHAPES["qwen3-30b-a3b-routing-replay.yaml"], cfg.trainer
    assert cfg.run.routing_replay and cfg.explorer.engine == "vllm" and not t.pack_sequences
    assert t.expert_parallel > 1 and t.data_parallel % t.expert_parallel == 0
    assert cfg.explorer.max_tokens == cfg.model.max_response_len == 16384
    assert cfg.model.max_prompt_len + cfg.model.max_response_len <= shape["max_position_embeddings"]
    assert cfg.kafka.compression == "zstd" and cfg.sync.weight_store.startswith("s3://")
    # every routing map and every token array of a long sample is claim-checked; a record stays under a default broker's
    # message.max.bytes
    assert cfg.records.claim_threshold_bytes < 4 * cfg.model.max_response_len and cfg.records.store.startswith("s3://")
    assert cfg.kafka.max_record_bytes <= 1_000_000 and not cfg.run.routing_prefill
    roles = ROLES_BY_MODE[cfg.run.mode]
    trainer_node = gpu_plan(cfg, ("trainer",), [str(i) for i in range(8)])
    assert trainer_node == {"trainer": "0,1,2,3,4,5,6,7"}
    explorer_node = gpu_plan(cfg, tuple(r for r in roles if r != "trainer"), [str(i) for i in range(8)])
    assert [explorer_node[f"explorer-{i}"] for i in range(8)] == [str(i) for i in range(8)]
    with pytest.raises(LaunchError, match="has 8 GPUs, the run needs 16"):
        gpu_plan(cfg, roles, [str(i) for i in range(8)])


def test_a_moe_recipe_whose_expert_parallelism_does_not_divide_the_experts_is_refused(tmp_path, monkeypatch):
    from rft.config import ConfigError

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(dict(SHAPES["qwen3-30b-a3b-routing-replay.yaml"], num_experts=60)))
    monkeypatch.setenv("MODEL_DIR", str(model))
    with pytest.raises(ConfigError, match="trainer.expert_parallel: 8 does not divide the model's 60 experts"):
        load_run_config(CONFIGS / "qwen3-30b-a3b-routing-replay.yaml",
                        ["trainer.data_parallel=8", "trainer.expert_parallel=8"])


def tiny_moe_as_the_makefile_writes_it(out: Path) -> Path:
    """The model `make tiny-moe-run` writes (its `rft tiny-model` line's arguments), into `out`."""
    from rft.models.tiny import main as tiny_model

    line = next(line for line in (REPO / "Makefile").read_text().splitlines()
                if "rft tiny-model assets/tiny-qwen3-moe" in line)
    assert tiny_model([str(out), *line.split("assets/tiny-qwen3-moe", 1)[1].split()]) == 0
    return out


def validated_against(config: Path, model: Path, capsys) -> tuple:
    """`rft validate CONFIG --set model.path=MODEL` passes; the loaded config and the model's config.json."""
    from rft.cli import main

    assert main(["validate", str(config), "--set", f"model.path={model}"]) == 0
    assert "valid" in capsys.readouterr().out
    cfg = load_run_config(config, [f"model.path={model}"], need_model=True)
    return cfg, json.loads((model / "config.json").read_text())


def test_the_tiny_moe_config_validates_against_its_model_with_expert_parallelism_and_routing_replay(tmp_path,
                                                                                                  capsys):
    model = tiny_moe_as_the_makefile_writes_it(tmp_path / "tiny-qwen3-moe")
    cfg, hf = validated_against(CONFIGS / "tiny-qwen3-moe.yaml", model, capsys)
    assert hf["architectures"] == ["Qwen3MoeForCausalLM"] and hf["num_local_experts"] % cfg.trainer.expert_parallel == 0
    assert cfg.trainer.expert_parallel == 2 and cfg.run.routing_replay
    assert cfg.explorer.engine == "transformers"  # the engine that records routing on a CPU
    assert cfg.model.max_prompt_len + cfg.model.max_response_len <= hf["max_position_embeddings"]


def test_the_tiny_vlm_config_validates_against_its_model_and_fits_every_easy_vqa_prompt(tmp_path, capsys):
    """configs/tiny-vlm.yaml against the model `make tiny-vlm-run` writes (its Makefile line's call, into tmp_path):
    `rft validate` passes, the trainer's TP divides the key/value heads, and the longest easy-VQA question of either
    split, its image's tokens counted, fits model.max_prompt_len (so the run refuses no task as too long)."""
    from rft.data import easy_vqa
    from rft.models.tiny_vlm import make_tiny_idefics3
    from rft.models.vision import load_processor, placeholder, process_prompt

    line = next(line for line in (REPO / "Makefile").read_text().splitlines() if "make_tiny_idefics3(" in line)
    assert "make_tiny_idefics3('assets/tiny-idefics3')" in line  # no other arguments: the call below
    model = make_tiny_idefics3(tmp_path / "tiny-idefics3")
    cfg, hf = validated_against(CONFIGS / "tiny-vlm.yaml", model, capsys)
    assert hf["text_config"]["num_key_value_heads"] % cfg.trainer.tensor_parallel == 0
    assert cfg.explorer.workflow == "single_turn" and cfg.data.format == "easy_vqa"
    assert [(s.format, s.path) for s in cfg.eval.sets] == [("easy_vqa", "test")]  # the held-out split

    processor = load_processor(model)
    image = easy_vqa.easy_vqa_rows("train", seed=0, size=1)[0]["images"][0]
    longest = max((q for split in easy_vqa.SPLITS for q, _, _ in easy_vqa._questions(easy_vqa.WHEEL, split)), key=len)
    tokens = process_prompt(processor, placeholder(processor) + longest, [(image.data, image.media_type)]).token_ids
    assert len(tokens) <= cfg.model.max_prompt_len, (longest, len(tokens))
