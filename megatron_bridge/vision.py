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

import torch
from megatron.core.models.gpt import GPTModel


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
                          pixel_attention_mask: torch.Tensor | None) -> torch.Tensor:
        """The decoder input [T, b, h]: token embeddings with the image features at the placeholders."""
        embeddings = self.embedding(input_ids=input_ids, position_ids=position_ids)  # [T, b, h]
        features = self.image_features(pixel_values, pixel_attention_mask)
        placeholders = input_ids == self.image_token_id  # [b, T]
        wanted, got = int(placeholders.sum()), features.shape[0] * features.shape[1]
        if wanted != got:
            raise ValueError(f"the micro-batch has {wanted} image placeholder tokens (id {self.image_token_id}) and "
                             f"its images give {got} features ({features.shape[0]} images x {features.shape[1]}): "
                             "the placeholders must be expanded once per image feature, as the processor does")
        mask = placeholders.t().unsqueeze(-1).expand_as(embeddings)
        # in [T, b] order the features must go in (row, position) order, as transformers' masked_scatter does
        ordered = torch.zeros_like(embeddings.transpose(0, 1))
        ordered = ordered.masked_scatter(placeholders.unsqueeze(-1).expand_as(ordered),
                                         features.reshape(-1, features.shape[-1]).to(embeddings.dtype))
        return torch.where(mask, ordered.transpose(0, 1), embeddings).contiguous()  # [T, b, h] as megatron sends it

    def forward(self, input_ids, position_ids, attention_mask, decoder_input=None, *,
                pixel_values: torch.Tensor | None = None, pixel_attention_mask: torch.Tensor | None = None,
                **kwargs):
        if self.pre_process and pixel_values is not None and decoder_input is None:
            decoder_input = self.merged_embeddings(input_ids, position_ids, pixel_values, pixel_attention_mask)
        return super().forward(input_ids, position_ids, attention_mask, decoder_input=decoder_input, **kwargs)
