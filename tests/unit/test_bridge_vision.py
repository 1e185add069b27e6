"""megatron_bridge's Idefics3 / SmolVLM family in one process: its mapping covers every HF tensor once, the vision
tower and connector belong to the first pipeline stage, config checks read the text model's sizes, and the options
the bridge cannot represent are refused by name. (Logits, export and training: tests/distributed.)"""
from __future__ import annotations

import json

import pytest
import torch
from transformers import Idefics3Config, Idefics3ForConditionalGeneration

from megatron_bridge.info import BridgeInfo
from megatron_bridge.layout import layout_problem, vocabulary_problem
from megatron_bridge.models import UnsupportedModelError, bridge_for


def idefics3(*, vision: dict | None = None, text: dict | None = None, **overrides) -> Idefics3Config:
    vision_config = {**dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                            image_size=32, patch_size=8), **(vision or {})}
    text_config = {**dict(model_type="llama", vocab_size=103, hidden_size=64, intermediate_size=128,
                          num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6),
                   **(text or {})}
    return Idefics3Config(vision_config=vision_config, text_config=text_config, **{
        "scale_factor": 2, "image_token_id": 100, "pad_token_id": 0, "tie_word_embeddings": False,
        "architectures": ["Idefics3ForConditionalGeneration"], **overrides})


@pytest.mark.parametrize("tied", [False, True])
def test_the_mapping_covers_every_hf_tensor_exactly_once(tied):
    config = idefics3(tie_word_embeddings=tied)
    bridge = bridge_for(config)
    names = [n for m in BridgeInfo(hf_dir=None, bridge=bridge, dims=bridge.dims(1), transformer_engine=False,
                                   pp=1).resolved_mappings() for n in m.hf_names]
    torch.manual_seed(0)
    hf = set(Idefics3ForConditionalGeneration(config).state_dict()) - ({"lm_head.weight"} if tied else set())
    assert len(names) == len(set(names)) and set(names) == hf


def test_the_vision_tower_and_connector_live_on_the_first_stage():
    bridge = bridge_for(idefics3())
    info = BridgeInfo(hf_dir=None, bridge=bridge, dims=bridge.dims(2), transformer_engine=False, pp=2)
    order = [m.megatron for m in info.resolved_mappings()]
    stages = {name: info.owner_stage(name) for name in order}
    assert order[0] == "embedding.word_embeddings.weight" and order[-1] == "output_layer.weight"
    tower = [n for n in order if n.startswith(("vision_model.", "connector."))]
    assert len(tower) == 2 * 16 + 5 + 1 and all(stages[n] == 0 and info.local_name(n, 0) == n for n in tower)
    assert order.index(tower[-1]) < order.index("decoder.layers.0.input_layernorm.weight")
    assert stages["decoder.final_layernorm.weight"] == 1 and stages["decoder.layers.2.mlp.linear_fc2.weight"] == 1


def test_megatron_gets_the_text_models_sizes():
    config = bridge_for(idefics3()).transformer_config(tp=2, pp=2, dtype="float32", on_cpu=True)
    assert (config.num_layers, config.hidden_size, config.num_attention_heads, config.num_query_groups) == (4, 64, 4, 2)
    assert not config.sequence_parallel


@pytest.mark.parametrize("overrides,named", [
    ({"vision": {"attention_dropout": 0.1}}, "vision_config.attention_dropout=0.1"),
    ({"text": {"attention_bias": True}}, "text_config.attention_bias=True"),
    ({"text": {"hidden_act": "gelu"}}, "text_config.hidden_act='gelu'"),
    ({"text": {"model_type": "qwen2"}}, "text_config.model_type='qwen2'"),
    ({"scale_factor": 3}, "scale_factor=3"),
    ({"vision": {"image_size": 36}}, "image_size=36"),
    ({"image_token_id": 103}, "image_token_id=103"),
])
def test_options_the_bridge_cannot_represent_are_refused_by_name(overrides, named):
    with pytest.raises(UnsupportedModelError, match=named.replace("(", r"\(").replace(".", r"\.")):
        bridge_for(idefics3(**overrides))


def test_config_checks_read_the_text_models_sizes(tmp_path):
    """A vision-language config.json keeps the language model's sizes under text_config: TP and PP split those."""
    vlm = tmp_path / "vlm"
    vlm.mkdir()
    idefics3().save_pretrained(vlm)
    assert layout_problem(str(vlm), tp=2, pp=2) is None
    assert "does not divide the model's 4 attention heads" in layout_problem(str(vlm), tp=3, pp=1)
    assert "does not divide the model's 4 layers" in layout_problem(str(vlm), tp=1, pp=3)
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"vocab_size": 99}))
    assert vocabulary_problem(str(vlm), str(vlm)) is None
    assert "vocab_size 99 and the student" in vocabulary_problem(str(vlm), str(other))


def test_the_check_commands_batch_holds_one_image_per_row_with_its_placeholders():
    import argparse

    from megatron_bridge.check import random_batch

    bridge = bridge_for(idefics3())
    args = argparse.Namespace(seed=0, batch=3, seq_len=12)
    batch = random_batch(args, 103, bridge)
    assert bridge.image_seq_len == 4 and batch["pixel_values"].shape == (3, 1, 3, 32, 32)
    assert ((batch["input_ids"] == 100).sum(1) == 4).all() and (batch["input_ids"][:, 1:5] == 100).all()
    with pytest.raises(ValueError, match="--seq-len 4 cannot hold an image's 4 placeholders"):
        random_batch(argparse.Namespace(seed=0, batch=1, seq_len=4), 103, bridge)
    assert "pixel_values" not in random_batch(args, 103, None)
