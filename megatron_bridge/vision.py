"""Vision-language models in megatron: the HF vision tower and connector inside megatron's GPTModel, on the first
pipeline stage (Megatron-Bridge's and slime's design: the tower replicated, the language model sharded).

`Idefics3GPTModel` is a GPTModel whose first stage also holds transformers' `Idefics3VisionTransformer`
(`vision_model`) and `Idefics3Connector` (`connector`), the modules themselves, so every vision option
transformers supports is reproduced as is. Its forward takes the micro-batch's `pixel_values`
[b, images, 3, H, W] (all-zero images are padding, as transformers drops them) and `pixel_attention_mask`
[b, images, H, W] (optional), embeds `input_ids` with megatron's vocabulary-parallel embedding and puts the
connector's outputs at the positions holding `image_token_id`, in row-major (row, position) order, exactly as
transformers' `Idefics3Model.inputs_merger`; the placeholders must already be expanded (the processor does it),
one per image feature: a count that differs raises ValueError naming both. Later stages never see images.

`Qwen25VLGPTModel` holds transformers' `Qwen2_5_VisionTransformerPretrainedModel` (`visual`: patch embedding,
window- and full-attention blocks, patch merger) the same way, takes `pixel_values` [patches, C*T*P*P] and
`image_grid_thw` [images, 3], and runs the language model with megatron's multimodal rotary embedding: every stage
computes the MRoPE positions [3, b, T] from `input_ids` and `image_grid_thw` with transformers' `get_rope_index`
(`mrope_positions`), so positions never travel between stages.

Placeholders are read only inside each row's prompt: both models' forwards take `prompt_lens` [b] (the batch
contract's; None: every position is prompt), and a placeholder token at a position >= its row's prompt length (a
response that sampled one) is an ordinary token, its embedding at text positions, as the engines treat one they
generated (vLLM merges image features only at the prompt's placeholder ranges, transformers' generate passes the
pixels only at the prefill step and gives decoded tokens text positions: Qwen2.5-VL's `rope_deltas`).

Tensor parallelism: every TP rank holds the whole tower and runs it on the same pixels (the micro-batch is the
same on every TP rank of a replica). The embedding's output is all-reduced over TP and, without sequence
parallelism (refused here), every TP rank's decoder input and the gradient flowing back into it are the same
(megatron all-reduces the gradient of each replicated activation where it enters a column-parallel layer), so
the tower's gradients are computed identically on every TP rank and need no reduction over TP: the same argument
that keeps megatron's own replicated norms unreduced. The tower has no dropout (the bridge refuses it): random
masks would differ between TP ranks. megatron counts replicated parameters once in the gradient norm
(`tensor_model_parallel` unset: TP rank 0's copy) and reduces gradients over data-parallel ranks as any other.
"""
from __future__ import annotations

import itertools
from functools import partial
from types import SimpleNamespace
from typing import Any

import torch
from megatron.core.models.gpt import GPTModel


def prompt_placeholders(input_ids: torch.Tensor, token_id: int, prompt_lens: torch.Tensor | None) -> torch.Tensor:
    """[b, T] bool: where `input_ids` [b, T] hold `token_id` inside their row's prompt (positions < `prompt_lens`
    [b]; every position when None), the only placeholders the model reads (module docstring)."""
    found = input_ids == token_id
    if prompt_lens is None:
        return found
    positions = torch.arange(input_ids.shape[1], device=input_ids.device)
    return found & (positions[None, :] < prompt_lens.to(input_ids.device)[:, None])


def check_placeholders(placeholders: torch.Tensor, image_token_id: int, features: int, described: str) -> None:
    """ValueError unless `placeholders` [b, T] (`prompt_placeholders` of `image_token_id`) mark exactly one position
    per image feature."""
    wanted = int(placeholders.sum())
    if wanted != features:
        raise ValueError(f"the micro-batch's prompts have {wanted} image placeholder tokens (id {image_token_id}) and "
                         f"its images give {features} features ({described}): the placeholders must be expanded "
                         "once per image feature, as the processor does")


def place_features(embeddings: torch.Tensor, placeholders: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
    """The decoder input [T, b, h]: `embeddings` [T, b, h] with `features` [n, h] at the `placeholders` [b, T] (n of
    them), in (row, position) order, as transformers' masked_scatter puts them."""
    mask = placeholders.t().unsqueeze(-1).expand_as(embeddings)
    ordered = torch.zeros_like(embeddings.transpose(0, 1))  # [b, T, h]: (row, position) order
    ordered = ordered.masked_scatter(placeholders.unsqueeze(-1).expand_as(ordered), features.to(embeddings.dtype))
    return torch.where(mask, ordered.transpose(0, 1), embeddings).contiguous()  # [T, b, h] as megatron sends it


class Idefics3GPTModel(GPTModel):
    """megatron's GPTModel plus, on the first stage, the Idefics3 vision tower and connector (module docstring)."""

    def __init__(self, vlm_config, *, image_token_id: int, **gpt_kwargs):
        from transformers.models.idefics3.modeling_idefics3 import Idefics3Connector, Idefics3VisionTransformer

        super().__init__(**gpt_kwargs)
        self.image_token_id = image_token_id
        if self.pre_process:
            self.vision_model = Idefics3VisionTransformer(vlm_config.vision_config)
            self.connector = Idefics3Connector(vlm_config)
            self.patch_size = int(vlm_config.vision_config.patch_size)
            if self.config.sequence_parallel:
                raise ValueError("a vision-language model under sequence parallelism is not supported")

    def image_features(self, pixel_values: torch.Tensor, pixel_attention_mask: torch.Tensor | None) -> torch.Tensor:
        """[images, tokens per image, hidden]: the connector's output for every real image of the micro-batch, in
        (row, image) order (transformers' `Idefics3Model.get_image_features`)."""
        b, n = pixel_values.shape[:2]
        dtype = next(self.vision_model.parameters()).dtype
        pixels = pixel_values.to(dtype).reshape(b * n, *pixel_values.shape[2:])
        real = (pixels == 0.0).sum(dim=(-1, -2, -3)) != pixels.shape[1:].numel()  # all-zero images are padding
        pixels = pixels[real].contiguous()
        if not pixels.shape[0]:  # only padding images: no features (and no placeholders may be there)
            return pixels.new_zeros(0, 0, self.config.hidden_size)
        if pixel_attention_mask is None:
            mask = torch.ones(pixels.shape[0], *pixels.shape[2:], dtype=torch.bool, device=pixels.device)
        else:
            mask = pixel_attention_mask.reshape(b * n, *pixel_attention_mask.shape[2:])[real].contiguous()
        size = self.patch_size
        patches = mask.unfold(1, size, size).unfold(2, size, size)
        patch_mask = patches.sum(dim=(-1, -2)) > 0
        hidden = self.vision_model(pixel_values=pixels, patch_attention_mask=patch_mask).last_hidden_state
        return self.connector(hidden)

    def merged_embeddings(self, input_ids: torch.Tensor, position_ids: torch.Tensor, pixel_values: torch.Tensor,
                          pixel_attention_mask: torch.Tensor | None,
                          prompt_lens: torch.Tensor | None = None) -> torch.Tensor:
        """The decoder input [T, b, h]: token embeddings with the image features at the prompts' placeholders."""
        embeddings = self.embedding(input_ids=input_ids, position_ids=position_ids)  # [T, b, h]
        features = self.image_features(pixel_values, pixel_attention_mask)
        placeholders = prompt_placeholders(input_ids, self.image_token_id, prompt_lens)
        check_placeholders(placeholders, self.image_token_id, features.shape[0] * features.shape[1],
                           f"{features.shape[0]} images x {features.shape[1]}")
        return place_features(embeddings, placeholders, features.reshape(-1, features.shape[-1]))

    def forward(self, input_ids, position_ids, attention_mask, decoder_input=None, *,
                pixel_values: torch.Tensor | None = None, pixel_attention_mask: torch.Tensor | None = None,
                prompt_lens: torch.Tensor | None = None, **kwargs):
        if self.pre_process and pixel_values is not None and decoder_input is None:
            decoder_input = self.merged_embeddings(input_ids, position_ids, pixel_values, pixel_attention_mask,
                                                   prompt_lens)
        return super().forward(input_ids, position_ids, attention_mask, decoder_input=decoder_input, **kwargs)


def mrope_positions(vlm_config, input_ids: torch.Tensor, image_grid_thw: torch.Tensor | None,
                    prompt_lens: torch.Tensor | None = None) -> torch.Tensor:
    """Qwen2.5-VL's multimodal rotary positions [3, b, T] of `input_ids` [b, T] (right-padded rows: padding gets
    positions after the row's, which no real token attends to), computed by transformers' own
    `Qwen2_5_VLModel.get_rope_index` with `mm_token_type_ids` 1 at the image placeholders inside each row's prompt
    (`prompt_placeholders`): a placeholder past the prompt is text, so the response's positions continue the prompt's
    one by one in all three sections, as the engines' decoding gives them (transformers' `rope_deltas`, vLLM's
    `mrope_position_delta`). ValueError when the prompts' placeholders are not, image by image in (row, position)
    order, one run of t*h*w / merge**2 tokens per `image_grid_thw` row, or when a prompt has video placeholders
    (videos are not taken)."""
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLModel

    image, video = int(vlm_config.image_token_id), getattr(vlm_config, "video_token_id", None)
    if video is not None and bool(prompt_placeholders(input_ids, int(video), prompt_lens).any()):
        raise ValueError(f"the micro-batch's prompts have video placeholder tokens (id {video}): videos are not "
                         "supported")
    placeholders = prompt_placeholders(input_ids, image, prompt_lens)
    merge = int(vlm_config.vision_config.spatial_merge_size)
    counts = [] if image_grid_thw is None else (image_grid_thw.prod(-1) // merge ** 2).tolist()
    check_placeholders(placeholders, image, sum(counts), f"{len(counts)} images of grids "
                       f"{[] if image_grid_thw is None else image_grid_thw.tolist()}, merged {merge}x{merge}")
    runs = [len(list(group)) for row in placeholders.tolist()
            for is_image, group in itertools.groupby(row) if is_image]
    if runs != counts:
        raise ValueError(f"the micro-batch's image placeholder runs have {runs} tokens and its images give {counts} "
                         "features each: each image's placeholders must be one run, images in (row, position) order")
    hf: Any = Qwen2_5_VLModel  # its two methods run on `holder`, which has all they read of a model
    holder = SimpleNamespace(config=vlm_config)
    holder.get_vision_position_ids = partial(hf.get_vision_position_ids, holder)
    positions, _ = hf.get_rope_index(holder, input_ids, placeholders.int(), image_grid_thw)
    return positions


class Qwen25VLGPTModel(GPTModel):
    """megatron's GPTModel (position_embedding_type "mrope") plus, on the first stage, transformers' Qwen2.5-VL
    vision tower with its patch merger (`visual`). Its forward takes `pixel_values` [patches, C*T*P*P] and
    `image_grid_thw` [images, 3] (every image of the micro-batch, in (row, position) order) and `prompt_lens` [b] on
    every stage: each stage computes the MRoPE positions (`mrope_positions`) from `input_ids`, the grids and the
    prompt lengths; the first stage puts the merger's outputs at the prompts' image placeholders (`place_features`).
    The positions given are ignored (the batch contract's 0..T-1); packed sequences are refused."""

    def __init__(self, vlm_config, **gpt_kwargs):
        from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel

        super().__init__(**gpt_kwargs)
        self.vlm_config = vlm_config
        if self.pre_process:
            self.visual = Qwen2_5_VisionTransformerPretrainedModel._from_config(vlm_config.vision_config)
            # a plain attribute, which dtype casts leave alone (`_apply`)
            self.tower_inv_freq = self.visual.rotary_pos_emb.inv_freq.detach().clone().float()
            if self.config.sequence_parallel:
                raise ValueError("a vision-language model under sequence parallelism is not supported")

    def _apply(self, fn, *args, **kwargs):
        """Moves and casts as nn.Module does, but keeps the tower's rotary frequencies in float32, as transformers
        loads them at any dtype (a bf16 copy would rotate the tower's queries and keys differently from the
        engine's)."""
        out = super()._apply(fn, *args, **kwargs)
        if self.pre_process:
            rope = self.visual.rotary_pos_emb
            for name in ("inv_freq", "original_inv_freq"):
                setattr(rope, name, self.tower_inv_freq.to(getattr(rope, name).device, copy=True))
        return out

    def merged_embeddings(self, input_ids: torch.Tensor, pixel_values: torch.Tensor | None,
                          image_grid_thw: torch.Tensor, prompt_lens: torch.Tensor | None = None) -> torch.Tensor:
        """The decoder input [T, b, h]: token embeddings with the merger's outputs at the prompts' image
        placeholders."""
        patches = int(image_grid_thw.prod(-1).sum())
        if pixel_values is None or pixel_values.dim() != 2 or pixel_values.shape[0] != patches:
            got = None if pixel_values is None else tuple(pixel_values.shape)
            raise ValueError(f"pixel_values {got} for images of grids {image_grid_thw.tolist()}: expected "
                             f"[{patches}, C*T*P*P]")
        embeddings = self.embedding(input_ids=input_ids, position_ids=None)  # [T, b, h]
        dtype = next(self.visual.parameters()).dtype
        features = self.visual(pixel_values.to(dtype), grid_thw=image_grid_thw).pooler_output  # [features, h]
        placeholders = prompt_placeholders(input_ids, int(self.vlm_config.image_token_id), prompt_lens)
        return place_features(embeddings, placeholders, features)

    def forward(self, input_ids, position_ids, attention_mask, decoder_input=None, *,
                pixel_values: torch.Tensor | None = None, image_grid_thw: torch.Tensor | None = None,
                prompt_lens: torch.Tensor | None = None, packed_seq_params=None, **kwargs):
        if packed_seq_params is not None:
            raise ValueError("packed sequences are not supported with MRoPE positions (Qwen2.5-VL)")
        if pixel_values is not None and image_grid_thw is None:
            raise ValueError("pixel_values without image_grid_thw")
        positions = mrope_positions(self.vlm_config, input_ids, image_grid_thw, prompt_lens)
        if self.pre_process and image_grid_thw is not None and len(image_grid_thw) and decoder_input is None:
            decoder_input = self.merged_embeddings(input_ids, pixel_values, image_grid_thw, prompt_lens)
        return super().forward(input_ids, positions, attention_mask, decoder_input=decoder_input, **kwargs)
