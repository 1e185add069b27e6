"""Idefics3 / SmolVLM (Idefics3ForConditionalGeneration) <-> megatron: a SigLIP vision tower and the pixel-shuffle
connector on the first pipeline stage, replicated over TP, and the Llama text model as megatron's GPT (TP/PP
sharded), whose input embeddings at the image placeholder positions are the connector's outputs
(megatron_bridge.vision). The text model's table is Llama's under `model.text_model.`; the vision tower's and the
connector's tensors map one to one (`Replicated`), their megatron names those of the HF modules the stage holds.
"""
from __future__ import annotations

from dataclasses import fields, replace
from typing import TYPE_CHECKING

from megatron_bridge.mapping import ParamMapping, Replicated
from megatron_bridge.models.base import VisionLanguageBridge, register
from megatron_bridge.models.llama import LLAMA_TABLE, LlamaBridge

if TYPE_CHECKING:
    import torch

VISION, CONNECTOR = "vision_model.", "connector."


def _text_model_names(mapping: ParamMapping) -> ParamMapping:
    """A Llama mapping with its HF names moved under `model.text_model.` (`lm_head.weight` stays)."""
    names = {f.name: getattr(mapping, f.name) for f in fields(mapping) if f.name != "megatron"}
    return replace(mapping, **{k: v.replace("model.", "model.text_model.", 1) if v.startswith("model.") else v
                               for k, v in names.items()})


TEXT_TABLE = tuple(_text_model_names(m) for m in LLAMA_TABLE)
# `*`: the vision encoder layer, resolved by `Idefics3Bridge.mappings` (these never go through the decoder's
# per-layer path)
VISION_LAYER_TABLE = tuple(
    Replicated(hf=f"model.vision_model.encoder.layers.*.{name}", megatron=f"{VISION}encoder.layers.*.{name}")
    for name in [f"self_attn.{p}_proj.{w}" for p in ("q", "k", "v", "out") for w in ("weight", "bias")]
    + [f"{n}.{w}" for n in ("layer_norm1", "layer_norm2", "mlp.fc1", "mlp.fc2") for w in ("weight", "bias")])
VISION_TABLE = tuple(
    Replicated(hf=f"model.{VISION}{name}", megatron=f"{VISION}{name}")
    for name in ("embeddings.patch_embedding.weight", "embeddings.patch_embedding.bias",
                 "embeddings.position_embedding.weight", "post_layernorm.weight", "post_layernorm.bias"))
CONNECTOR_TABLE = (Replicated(hf=f"model.{CONNECTOR}modality_projection.proj.weight",
                              megatron=f"{CONNECTOR}modality_projection.proj.weight"),)


@register("Idefics3ForConditionalGeneration")
class Idefics3Bridge(VisionLanguageBridge):
    """Idefics3 and SmolVLM (SmolVLM's checkpoints name this class too): the text model must be a Llama (what
    SmolVLM and Idefics3 ship); `self.hf` is its text config, `self.vlm` the whole config. Refused: vision
    dropout (each TP rank runs the replicated tower with its own random stream, so their masks would differ), a
    text model other than Llama, an image token outside the vocabulary, a pixel shuffle that does not divide the
    patch grid."""

    first_stage_prefixes = (VISION, CONNECTOR)
    mapping_table = TEXT_TABLE
    image_keys = ("pixel_values", "pixel_attention_mask")

    @property
    def image_size(self) -> int:
        return int(self.vlm.vision_config.image_size)

    @property
    def image_seq_len(self) -> int:
        """Placeholder tokens (features) per image: the patch grid over the pixel shuffle's factor squared."""
        vision = self.vlm.vision_config
        return (vision.image_size // vision.patch_size) ** 2 // int(self.vlm.scale_factor) ** 2

    def collate_images(self, per_row: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """`pixel_values` [b, max images, 3, H, W] and `pixel_attention_mask` [b, max images, H, W] (when the
        rows' processor gave one) from each row's processor output (`pixel_values` [1, n, 3, H, W], the mask
        [1, n, H, W]; {} for a text or padding row): a row's images first, then all-zero padding images with an
        all-False mask, which the model drops as transformers does (megatron_bridge.vision); a text row gets only
        padding images. {} when no row has images. ValueError naming the row when its tensors are not of that shape,
        its images are not the size of the others', or it carries a key Idefics3 does not take."""
        images: list[torch.Tensor | None] = []
        masks: list[torch.Tensor | None] = []
        for i, pixels in enumerate(per_row):
            if unknown := sorted(set(pixels) - set(self.image_keys)):
                raise ValueError(f"row {i}: image tensors {unknown} are not Idefics3's (it takes {self.image_keys})")
            values, mask = pixels.get("pixel_values"), pixels.get("pixel_attention_mask")
            if values is None:
                if mask is not None:
                    raise ValueError(f"row {i}: a pixel_attention_mask without pixel_values")
                images.append(None)
                masks.append(None)
                continue
            values = values[0] if values.dim() == 5 and values.shape[0] == 1 else values
            if values.dim() != 4 or values.shape[1] != 3:
                raise ValueError(f"row {i}: pixel_values of shape {tuple(pixels['pixel_values'].shape)}, not one "
                                 "prompt's [1, images, 3, H, W]")
            if mask is not None:
                mask = mask[0] if mask.dim() == 4 and mask.shape[0] == 1 else mask
                if tuple(mask.shape) != (values.shape[0], *values.shape[2:]):
                    raise ValueError(f"row {i}: pixel_attention_mask of shape {tuple(mask.shape)} for pixel_values "
                                     f"{tuple(values.shape)}")
            images.append(values)
            masks.append(mask)
        real = [v for v in images if v is not None]
        if not real:
            return {}
        size = tuple(real[0].shape[1:])
        for i, values in enumerate(images):
            if values is not None and tuple(values.shape[1:]) != size:
                raise ValueError(f"row {i}: images of {tuple(values.shape[1:])}, another row's are {size} (the "
                                 "processor gives every image or tile the vision tower's size)")
        most = max(v.shape[0] for v in real)
        out = {"pixel_values": real[0].new_zeros(len(images), most, *size)}
        for i, values in enumerate(images):
            if values is not None:
                out["pixel_values"][i, :values.shape[0]] = values
        given = [m for m in masks if m is not None]
        if given:
            out["pixel_attention_mask"] = given[0].new_zeros(len(images), most, *size[1:])
            for i, (values, mask) in enumerate(zip(images, masks, strict=True)):
                if values is not None:  # a row without a mask: its images whole
                    out["pixel_attention_mask"][i, :values.shape[0]] = mask if mask is not None else 1
        return out

    def unsupported_options(self) -> list[str]:
        text, vision, problems = self.hf, self.vlm.vision_config, []
        if getattr(text, "model_type", None) != "llama":
            problems.append(f"text_config.model_type={getattr(text, 'model_type', None)!r} (only 'llama')")
        problems += [f"text_config.{p}" for p in super().unsupported_options()]
        problems += [f"text_config.{p}" for p in LlamaBridge.llama_refusals(text)]
        if float(getattr(vision, "attention_dropout", 0.0) or 0.0):
            problems.append(f"vision_config.attention_dropout={vision.attention_dropout} (the vision tower runs "
                            "replicated on every TP rank, which would draw different dropout masks)")
        side = vision.image_size // vision.patch_size
        scale = int(getattr(self.vlm, "scale_factor", 1))
        if vision.image_size % vision.patch_size or side % scale:
            problems.append(f"vision_config.image_size={vision.image_size} with patch_size={vision.patch_size} and "
                            f"scale_factor={scale} (the pixel shuffle needs whole patches in a grid it divides)")
        if not 0 <= int(self.vlm.image_token_id) < text.vocab_size:
            problems.append(f"image_token_id={self.vlm.image_token_id} outside the vocabulary of {text.vocab_size}")
        return problems

    def build_model(self, *, config, spec, pre_process: bool, post_process: bool, tp: int):
        from megatron_bridge.vision import Idefics3GPTModel  # heavy: megatron.core, transformers

        return Idefics3GPTModel(self.vlm, image_token_id=self.image_token_id, config=config,
                                transformer_layer_spec=spec, pre_process=pre_process, post_process=post_process,
                                **self.gpt_model_kwargs(tp))

    def mappings(self) -> list[ParamMapping]:
        """The text model's mappings (its embedding first), then the vision tower's, layer by layer, and the
        connector's, all resolved (no `*`): in pipeline order they belong to the first stage."""
        text = super().mappings()
        vision = list(VISION_TABLE[:3]) + [m.for_layer(i) for i in range(self.vlm.vision_config.num_hidden_layers)
                                           for m in VISION_LAYER_TABLE] + list(VISION_TABLE[3:])
        return text[:1] + vision + list(CONNECTOR_TABLE) + text[1:]
