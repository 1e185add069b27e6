"""Qwen2.5-VL (Qwen2_5_VLForConditionalGeneration) <-> megatron: transformers' Qwen2.5-VL vision tower (patch
embedding, window/full-attention blocks, patch merger) on the first pipeline stage, replicated over TP, and the
Qwen2 text model as megatron's GPT (TP/PP sharded) with multimodal rotary positions (`position_embedding_type
"mrope"`, `mrope_section` from the text config), computed from the token ids and `image_grid_thw` by transformers'
own `get_rope_index` (megatron_bridge.vision). The checkpoint's names are Qwen2's (`model.layers.*`, what the hub's
Qwen2.5-VL checkpoints and transformers 5 write) plus `visual.*`, which map one to one (`Replicated`) to the stage's
`visual` module.

Forward kwargs (`image_keys`): `pixel_values` [patches, C*T*P*P] (every image's flattened patches, concatenated)
and `image_grid_thw` [images, 3]; `collate_images` concatenates rows' images in row order.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from megatron_bridge.mapping import ParamMapping, Replicated
from megatron_bridge.models.base import VisionLanguageBridge, register
from megatron_bridge.models.qwen2 import QWEN2_TABLE, window_refusals
from rft.lazy import lazy

if TYPE_CHECKING:
    import torch
else:
    torch = lazy("torch")  # the registry is read by config checks, without torch

VISUAL = "visual."
DEFAULT_MROPE_SECTION = (16, 24, 24)  # transformers' default when the text config has none
VISUAL_LAYER_TABLE = tuple(
    Replicated(hf=f"{VISUAL}blocks.*.{name}", megatron=f"{VISUAL}blocks.*.{name}")
    for name in [f"attn.{p}.{w}" for p in ("qkv", "proj") for w in ("weight", "bias")]
    + [f"mlp.{p}_proj.{w}" for p in ("gate", "up", "down") for w in ("weight", "bias")]
    + ["norm1.weight", "norm2.weight"])
PATCH_EMBED = Replicated(hf=f"{VISUAL}patch_embed.proj.weight", megatron=f"{VISUAL}patch_embed.proj.weight")
MERGER_TABLE = tuple(Replicated(hf=f"{VISUAL}merger.{name}", megatron=f"{VISUAL}merger.{name}")
                     for name in ("ln_q.weight", "mlp.0.weight", "mlp.0.bias", "mlp.2.weight", "mlp.2.bias"))
IMAGE_KEYS = ("pixel_values", "image_grid_thw")


@register("Qwen2_5_VLForConditionalGeneration")
class Qwen25VLBridge(VisionLanguageBridge):
    """Qwen2.5-VL; `self.hf` is its text config, `self.vlm` the whole config. Refused: sliding-window attention in
    the text model, a rope other than the default MRoPE, an `mrope_section` that does not cover half the head
    dimension, a merger whose output is not the text model's width, a vision window smaller than one merged patch,
    image/video tokens outside the vocabulary. Videos are not taken (a micro-batch with video placeholders is
    refused)."""

    first_stage_prefixes = (VISUAL,)
    qkv_bias = True
    mapping_table = QWEN2_TABLE
    image_keys = IMAGE_KEYS

    @property
    def mrope_section(self) -> list[int]:
        return [int(n) for n in self.rope().get("mrope_section", DEFAULT_MROPE_SECTION)]

    def unsupported_options(self) -> list[str]:
        text, vision, problems = self.hf, self.vlm.vision_config, []
        problems += [f"text_config.{p}" for p in super().unsupported_options() + window_refusals(text)]
        section = self.mrope_section
        if len(section) != 3 or 2 * sum(section) != self.head_dim:
            problems.append(f"text_config mrope_section={section} (three sections summing to half the head "
                            f"dimension, {self.head_dim // 2})")
        if int(vision.out_hidden_size) != int(text.hidden_size):
            problems.append(f"vision_config.out_hidden_size={vision.out_hidden_size} (the merger must give the "
                            f"text model's hidden_size, {text.hidden_size})")
        merged = int(vision.spatial_merge_size) * int(vision.patch_size)
        if int(vision.window_size) < merged:
            problems.append(f"vision_config.window_size={vision.window_size} (smaller than one merged patch, "
                            f"{merged} pixels)")
        for key in ("image_token_id", "video_token_id"):
            value = getattr(self.vlm, key, None)
            if value is not None and not 0 <= int(value) < text.vocab_size:
                problems.append(f"{key}={value} outside the vocabulary of {text.vocab_size}")
        return problems

    def transformer_config(self, **kwargs):
        config = super().transformer_config(**kwargs)
        config.mrope_section = self.mrope_section  # megatron's GPTModel reads it for position_embedding_type mrope
        return config

    def gpt_model_kwargs(self, tp: int) -> dict[str, Any]:
        return {**super().gpt_model_kwargs(tp), "position_embedding_type": "mrope"}

    def build_model(self, *, config, spec, pre_process: bool, post_process: bool, tp: int):
        from megatron_bridge.vision import Qwen25VLGPTModel  # heavy: megatron.core, transformers

        return Qwen25VLGPTModel(self.vlm, config=config, transformer_layer_spec=spec, pre_process=pre_process,
                                post_process=post_process, **self.gpt_model_kwargs(tp))

    def mappings(self) -> list[ParamMapping]:
        """The text model's mappings (its embedding first), then the vision tower's, block by block, and the
        merger's, all resolved (no `*`): in pipeline order they belong to the first stage."""
        text = super().mappings()
        blocks = [m.for_layer(i) for i in range(int(self.vlm.vision_config.depth)) for m in VISUAL_LAYER_TABLE]
        return text[:1] + [PATCH_EMBED] + blocks + list(MERGER_TABLE) + text[1:]

    def collate_images(self, per_row: list[dict[str, Any]]) -> dict[str, Any]:
        """One micro-batch's image tensors from its rows' (`ProcessedPrompt.pixels`, {} for a text row): every
        row's `pixel_values` and `image_grid_thw` concatenated along dim 0, rows in order ({} when no row has an
        image). ValueError naming the row and key for anything else (a missing or unknown key, a row whose patches
        are not its grids' count, patches of a different width)."""
        pixels: list[torch.Tensor] = []
        grids: list[torch.Tensor] = []
        for row, tensors in enumerate(per_row):
            if not tensors:
                continue
            if set(tensors) != set(IMAGE_KEYS):
                raise ValueError(f"row {row}: image tensors {sorted(tensors)}, expected {list(IMAGE_KEYS)}")
            values, grid = torch.as_tensor(tensors["pixel_values"]), torch.as_tensor(tensors["image_grid_thw"])
            if grid.dim() != 2 or grid.shape[1] != 3 or grid.dtype.is_floating_point or bool((grid < 1).any()):
                raise ValueError(f"row {row}: image_grid_thw must be positive integers [images, 3], got "
                                 f"{grid.dtype} {tuple(grid.shape)}")
            patches = int(grid.prod(-1).sum())
            if values.dim() != 2 or values.shape[0] != patches:
                raise ValueError(f"row {row}: pixel_values {tuple(values.shape)} for grids of {patches} patches")
            if pixels and values.shape[1] != pixels[0].shape[1]:
                raise ValueError(f"row {row}: pixel_values patches of {values.shape[1]} values, earlier rows' "
                                 f"{pixels[0].shape[1]}")
            pixels.append(values)
            grids.append(grid.to(torch.int64))
        if not pixels:
            return {}
        return {"pixel_values": torch.cat(pixels), "image_grid_thw": torch.cat(grids)}
