"""Idefics3 / SmolVLM (Idefics3ForConditionalGeneration) <-> megatron: a SigLIP vision tower and the pixel-shuffle
connector on the first pipeline stage, replicated over TP, and the Llama text model as megatron's GPT (TP/PP
sharded), whose input embeddings at the image placeholder positions are the connector's outputs
(megatron_bridge.vision). The text model's table is Llama's under `model.text_model.`; the vision tower's and the
connector's tensors map one to one (`Replicated`), their megatron names those of the HF modules the stage holds.
"""
from __future__ import annotations

from dataclasses import fields, replace

from megatron_bridge.mapping import ParamMapping, Replicated
from megatron_bridge.models.base import DecoderBridge, register
from megatron_bridge.models.llama import LLAMA_TABLE, LlamaBridge

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
class Idefics3Bridge(DecoderBridge):
    """Idefics3 and SmolVLM (SmolVLM's checkpoints name this class too): the text model must be a Llama (what
    SmolVLM and Idefics3 ship); `self.hf` is its text config, `self.vlm` the whole config. Refused: vision
    dropout (each TP rank runs the replicated tower with its own random stream, so their masks would differ), a
    text model other than Llama, an image token outside the vocabulary, a pixel shuffle that does not divide the
    patch grid."""

    first_stage_prefixes = (VISION, CONNECTOR)
    mapping_table = TEXT_TABLE

    def __init__(self, hf_config):
        self.vlm = hf_config
        super().__init__(hf_config.text_config)

    @property
    def tied_embeddings(self) -> bool:
        return bool(getattr(self.vlm, "tie_word_embeddings", False))  # transformers ties by the outer config's

    @property
    def image_token_id(self) -> int:
        return int(self.vlm.image_token_id)

    @property
    def image_size(self) -> int:
        return int(self.vlm.vision_config.image_size)

    @property
    def image_seq_len(self) -> int:
        """Placeholder tokens (features) per image: the patch grid over the pixel shuffle's factor squared."""
        vision = self.vlm.vision_config
        return (vision.image_size // vision.patch_size) ** 2 // int(self.vlm.scale_factor) ** 2

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
