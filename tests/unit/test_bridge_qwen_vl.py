"""megatron_bridge's Qwen2.5-VL family in one process: its mapping covers every tensor of the checkpoint once, the
vision tower belongs to the first pipeline stage, megatron gets MRoPE with the config's sections (a hub config's
flat layout too), the MRoPE positions are transformers', mismatched placeholders are refused, images collate in row
order, and the options the bridge cannot represent are refused by name. (Logits, export and training:
tests/distributed.)"""
from __future__ import annotations

import argparse
import re

import pytest
import torch
from safetensors import safe_open
from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2Config

from megatron_bridge.info import BridgeInfo
from megatron_bridge.models import UnsupportedModelError, bridge_for

IMAGE, VIDEO, START, END = 100, 101, 98, 99


def qwen_vl(*, vision: dict | None = None, text: dict | None = None, **overrides) -> Qwen2_5_VLConfig:
    vision_config = {**dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=8,
                            spatial_merge_size=2, temporal_patch_size=2, window_size=32, out_hidden_size=64,
                            fullatt_block_indexes=[1]), **(vision or {})}
    text_config = {**dict(vocab_size=103, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                          num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6,
                          rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}),
                   **(text or {})}
    return Qwen2_5_VLConfig(vision_config=vision_config, text_config=text_config, **{
        "image_token_id": IMAGE, "video_token_id": VIDEO, "vision_start_token_id": START, "vision_end_token_id": END,
        "tie_word_embeddings": False, "architectures": ["Qwen2_5_VLForConditionalGeneration"], **overrides})


def resolved_hf_names(config) -> list[str]:
    bridge = bridge_for(config)
    info = BridgeInfo(hf_dir=None, bridge=bridge, dims=bridge.dims(1), transformer_engine=False, pp=1)
    return [n for m in info.resolved_mappings() for n in m.hf_names]


@pytest.mark.parametrize("tied", [False, True])
def test_the_mapping_covers_every_checkpoint_tensor_exactly_once(tmp_path, tied):
    """Against the names transformers writes (Qwen2's `model.layers.*` and `visual.*`, as the hub's checkpoints)."""
    config = qwen_vl(tie_word_embeddings=tied)
    torch.manual_seed(0)
    Qwen2_5_VLForConditionalGeneration(config).save_pretrained(tmp_path)
    with safe_open(tmp_path / "model.safetensors", framework="pt") as f:
        saved = set(f.keys()) - ({"lm_head.weight"} if tied else set())
    names = resolved_hf_names(config)
    assert len(names) == len(set(names)) and set(names) == saved


def test_the_vision_tower_lives_on_the_first_stage_and_megatron_gets_mrope():
    bridge = bridge_for(qwen_vl())
    info = BridgeInfo(hf_dir=None, bridge=bridge, dims=bridge.dims(2), transformer_engine=False, pp=2)
    order = [m.megatron for m in info.resolved_mappings()]
    tower = [n for n in order if n.startswith("visual.")]
    assert len(tower) == 1 + 2 * 12 + 5 and all(info.owner_stage(n) == 0 and info.local_name(n, 0) == n for n in tower)
    assert order[0] == "embedding.word_embeddings.weight" and order[-1] == "output_layer.weight"
    assert order.index(tower[-1]) < order.index("decoder.layers.0.input_layernorm.weight")
    assert info.owner_stage("decoder.layers.2.mlp.linear_fc2.weight") == 1
    config = bridge.transformer_config(tp=2, pp=2, dtype="float32", on_cpu=True)
    assert config.mrope_section == [2, 3, 3] and config.add_qkv_bias and not config.sequence_parallel
    assert (config.num_layers, config.hidden_size, config.num_query_groups) == (4, 64, 2)
    assert bridge.gpt_model_kwargs(2)["position_embedding_type"] == "mrope" and bridge.image_keys == (
        "pixel_values", "image_grid_thw")


def test_a_hub_style_flat_config_with_mrope_rope_scaling_is_read():
    """The hub's Qwen2.5-VL config.json keeps the text keys at the top and `rope_scaling: {type: mrope, ...}`."""
    flat = dict(vocab_size=103, hidden_size=256, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                num_key_value_heads=1, rope_theta=1000000.0,
                rope_scaling={"type": "mrope", "mrope_section": [16, 24, 24]},
                vision_config=dict(depth=1, hidden_size=32, num_heads=2, out_hidden_size=256),
                image_token_id=IMAGE, video_token_id=VIDEO, architectures=["Qwen2_5_VLForConditionalGeneration"])
    bridge = bridge_for(Qwen2_5_VLConfig(**flat))
    assert bridge.mrope_section == [16, 24, 24] and bridge.rope()["rope_theta"] == 1000000.0


@pytest.mark.parametrize("overrides,named", [
    ({"text": {"use_sliding_window": True, "sliding_window": 16, "max_window_layers": 0}},
     "text_config.use_sliding_window=True"),
    ({"text": {"layer_types": ["full_attention", "sliding_attention"] * 2}}, "text_config.layer_types="),
    ({"text": {"hidden_act": "gelu"}}, "text_config.hidden_act='gelu'"),
    ({"text": {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "mrope_section": [2, 2, 2]}}},
     "mrope_section=[2, 2, 2]"),
    ({"text": {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4,
                                   "mrope_section": [2, 3, 3]}}}, "text_config.rope_type='linear'"),
    ({"vision": {"out_hidden_size": 32}}, "vision_config.out_hidden_size=32"),
    ({"vision": {"window_size": 8}}, "vision_config.window_size=8"),
    ({"image_token_id": 103}, "image_token_id=103"),
])
def test_options_the_bridge_cannot_represent_are_refused_by_name(overrides, named):
    with pytest.raises(UnsupportedModelError, match=re.escape(named)):
        bridge_for(qwen_vl(**overrides))


def rows(*layouts: list) -> torch.Tensor:
    """Token rows from layouts: an int is a text token, ("img", n) a `<|vision_start|>`, n placeholders,
    `<|vision_end|>` block; rows right-padded with 0."""
    out = []
    for layout in layouts:
        row: list[int] = []
        for part in layout:
            row += [START] + [IMAGE] * part[1] + [END] if isinstance(part, tuple) else [part]
        out.append(row)
    width = max(map(len, out))
    return torch.tensor([row + [0] * (width - len(row)) for row in out])


def test_mrope_positions_are_transformers_own():
    """By hand for one image (grid 1x4x4 merged 2x2: a 2x2 block of placeholders at t = h = w = 3 + offsets), and
    equal to what transformers' Qwen2_5_VLModel computes in its forward for a padded batch of three images."""
    from megatron_bridge.vision import mrope_positions

    config = qwen_vl()
    ids = rows([5, 6, ("img", 4), 7])
    positions = mrope_positions(config, ids, torch.tensor([[1, 4, 4]]))
    assert positions.shape == (3, 1, 9)
    assert positions[:, 0].tolist() == [[0, 1, 2, 3, 3, 3, 3, 5, 6], [0, 1, 2, 3, 3, 4, 4, 5, 6],
                                        [0, 1, 2, 3, 4, 3, 4, 5, 6]]

    ids = rows([5, ("img", 4), 7, 8], [("img", 12), 9, ("img", 4), 10, 11])
    grids = torch.tensor([[1, 4, 4], [1, 8, 6], [1, 4, 4]])
    torch.manual_seed(0)
    model = Qwen2_5_VLForConditionalGeneration(config).model
    expected = model.compute_3d_position_ids(input_ids=ids, image_grid_thw=grids, video_grid_thw=None,
                                             inputs_embeds=None, attention_mask=None, past_key_values=None,
                                             mm_token_type_ids=(ids == IMAGE).int())
    assert torch.equal(mrope_positions(config, ids, grids), expected)
    text = rows([5, 6, 7])
    assert torch.equal(mrope_positions(config, text, None), torch.arange(3).expand(3, 1, 3))


def test_placeholders_past_the_prompt_are_text_at_the_positions_transformers_decodes_them():
    """With `prompt_lens`, a response's image and video placeholders are ordinary tokens: no image feature is
    expected for them, and every response position equals the one transformers gives the token when it decodes it
    after the prompt's prefill (compute_3d_position_ids with a cache: the text position plus `rope_deltas`), row by
    row of a right-padded batch; a video placeholder inside a prompt is still refused."""
    from types import SimpleNamespace

    from megatron_bridge.vision import mrope_positions

    config = qwen_vl()
    prompts = [[5, ("img", 4), 7], [("img", 12), 9, ("img", 4), 10]]
    responses = [[IMAGE, 8, VIDEO, IMAGE], [11, IMAGE]]
    grids = [torch.tensor([[1, 4, 4]]), torch.tensor([[1, 8, 6], [1, 4, 4]])]
    ids = rows(*[p + r for p, r in zip(prompts, responses, strict=True)])
    lens = torch.tensor([len(rows(p)[0]) for p in prompts])
    got = mrope_positions(config, ids, torch.cat(grids), lens)
    torch.manual_seed(0)
    model = Qwen2_5_VLForConditionalGeneration(config).model
    for row, grid in enumerate(grids):
        n = int(lens[row])
        prefill = ids[row:row + 1, :n]
        model.rope_deltas = None
        expected = [model.compute_3d_position_ids(
            input_ids=prefill, image_grid_thw=grid, video_grid_thw=None, inputs_embeds=None, attention_mask=None,
            past_key_values=None, mm_token_type_ids=(prefill == IMAGE).int())[:, 0]]
        for j in range(n, n + len(responses[row])):  # one decoded token at a time, after j cached ones
            expected.append(model.compute_3d_position_ids(
                input_ids=ids[row:row + 1, j:j + 1], image_grid_thw=None, video_grid_thw=None,
                inputs_embeds=torch.zeros(1, 1, 64), attention_mask=None,
                past_key_values=SimpleNamespace(get_seq_length=lambda j=j: j), mm_token_type_ids=None)[:, 0])
        expected_row = torch.cat(expected, dim=1)
        assert torch.equal(got[:, row, :expected_row.shape[1]], expected_row), row
        assert bool((expected_row[:, n:] > expected_row[:, :n].max()).all())  # text positions after the image's
    with pytest.raises(ValueError, match="prompts have 17 image placeholder tokens"):  # the whole row as prompt
        mrope_positions(config, ids[1:], grids[1])
    video = rows([5, VIDEO, ("img", 4), 7])
    with pytest.raises(ValueError, match=re.escape("video placeholder tokens (id 101): videos are not supported")):
        mrope_positions(config, video, grids[0], torch.tensor([8]))


@pytest.mark.parametrize("ids,grids,message", [
    (rows([5, ("img", 3), 6]), [[1, 4, 4]], "3 image placeholder tokens (id 100) and its images give 4 features (1 "
                                            "images of grids [[1, 4, 4]], merged 2x2)"),
    (rows([5, ("img", 4), 6]), None, "4 image placeholder tokens (id 100) and its images give 0 features"),
    (rows([("img", 4), ("img", 12)]), [[1, 8, 6], [1, 4, 4]], "placeholder runs have [4, 12] tokens and its images "
                                                                "give [12, 4] features"),
    (rows([5, VIDEO, 6]), None, "video placeholder tokens (id 101): videos are not supported"),
])
def test_placeholders_that_do_not_match_the_images_are_refused(ids, grids, message):
    from megatron_bridge.vision import mrope_positions

    with pytest.raises(ValueError, match=re.escape(message)):
        mrope_positions(qwen_vl(), ids, None if grids is None else torch.tensor(grids))


def test_collate_images_concatenates_rows_in_order():
    bridge = bridge_for(qwen_vl())
    a = {"pixel_values": torch.ones(16, 384), "image_grid_thw": torch.tensor([[1, 4, 4]])}
    b = {"pixel_values": torch.full((64, 384), 2.0), "image_grid_thw": torch.tensor([[1, 4, 4], [1, 4, 12]])}
    out = bridge.collate_images([a, {}, b])
    assert out["image_grid_thw"].tolist() == [[1, 4, 4], [1, 4, 4], [1, 4, 12]]
    assert out["pixel_values"].shape == (80, 384) and out["pixel_values"][16:].eq(2.0).all()
    assert bridge.collate_images([{}, {}]) == {}
    with pytest.raises(ValueError, match=r"row 1: pixel_values \(15, 384\) for grids of 16 patches"):
        bridge.collate_images([a, {**a, "pixel_values": torch.ones(15, 384)}])
    with pytest.raises(ValueError, match=r"row 0: image tensors \['pixel_values'\], expected"):
        bridge.collate_images([{"pixel_values": a["pixel_values"]}])
    with pytest.raises(ValueError, match="row 1: pixel_values patches of 3 values, earlier rows' 384"):
        bridge.collate_images([a, {"pixel_values": torch.ones(16, 3), "image_grid_thw": a["image_grid_thw"]}])
    text_only = Qwen2Config(vocab_size=103, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, architectures=["Qwen2ForCausalLM"])
    with pytest.raises(ValueError, match="Qwen2ForCausalLM takes no images"):
        bridge_for(text_only).collate_images([a])


def test_the_check_commands_batch_holds_one_grid_image_per_row():
    from megatron_bridge.check import random_batch

    bridge = bridge_for(qwen_vl())
    batch = random_batch(argparse.Namespace(seed=0, batch=3, seq_len=12), 103, bridge)
    assert batch["image_grid_thw"].tolist() == [[1, 4, 4]] * 3 and batch["pixel_values"].shape == (48, 384)
    assert ((batch["input_ids"] == IMAGE).sum(1) == 4).all() and (batch["input_ids"][:, 1:5] == IMAGE).all()
    assert not (batch["input_ids"] == VIDEO).any()
    assert torch.equal(batch["mm_token_type_ids"], (batch["input_ids"] == IMAGE).int())
