"""A tiny seeded Idefics3 (SmolVLM's architecture: a SigLIP vision tower, the pixel-shuffle connector, a Llama text
model) in Hugging Face format with its processor, for tests of the bridge, the engines and serve: randomly
initialised, same seed, same bytes; nothing downloaded.

The tokenizer is rft.models.tiny's character tokenizer (every character its own piece, newlines too: the processor
writes "\\n\\n" between an image's rows and its global view) plus Idefics3's image tokens (`<fake_token_around_image>`,
`<image>`, `<end_of_utterance>`, `<global-img>`, `<row_i_col_j>`), and a small chat template that renders image parts
as `<image>`. The processor is transformers' `Idefics3Processor` with its PIL image processor: each image is resized
to `image_size` pixels square and gives `image_seq_len(...)` placeholders (4 by default), or, with `longest_edge`,
resized to that and split into `image_size` tiles plus a global view, as SmolVLM does.

`make_tiny_qwen2_5_vl` writes a tiny Qwen2.5-VL the same way: the character tokenizer plus Qwen's chat and vision
tokens (`<|im_start|>`, `<|im_end|>`, `<|vision_start|>`, `<|image_pad|>`, `<|vision_end|>`, `<|video_pad|>`), a
chat template rendering image parts as `<|vision_start|><|image_pad|><|vision_end|>`, and transformers'
`Qwen2VLImageProcessorPil` (small min/max pixels: a 32x32 image gives 16 patches, 4 placeholders; a 64x64 one 64
patches, 16 placeholders). Its vision tower has one window-attention block and one full-attention block.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from rft.models.tiny import build_tokenizer, save_tiny

IMAGE_TOKENS = (["<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>"]
                + [f"<row_{i}_col_{j}>" for i in range(1, 7) for j in range(1, 7)])


def chat_template(turn_start: str, image: str, turn_end: str, generation_prompt: str) -> str:
    """A chat template: each message `turn_start` (Jinja, may use `message`), its content (a string, or parts:
    image parts as `image`, text parts as is), then `turn_end`; `generation_prompt` after the last turn when asked."""
    return ("{% for message in messages %}" + turn_start
            + "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
            "{% for part in message['content'] %}{% if part['type'] == 'image' %}" + image
            + "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
            + turn_end + "{% endfor %}{% if add_generation_prompt %}" + generation_prompt + "{% endif %}")


# user turns: image parts as <image>, text as is; each turn ends with <end_of_utterance>
CHAT_TEMPLATE = chat_template("{{ message['role'] | capitalize }}:", "<image>", "<end_of_utterance>\n", "Assistant:")
QWEN_VL_TOKENS = ["<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>",
                  "<|video_pad|>"]
QWEN_VL_CHAT_TEMPLATE = chat_template("<|im_start|>{{ message['role'] }}\n",
                                      "<|vision_start|><|image_pad|><|vision_end|>", "<|im_end|>\n",
                                      "<|im_start|>assistant\n")


# a jinja macro rendering a message's content as `chat_template` does with `<image>` for image parts, for a text
# model's own template (`with_image_parts`)
IMAGE_PARTS = ("{% macro image_parts(content) %}{% if content is string %}{{ content }}{% else %}"
               "{% for part in content %}{% if part['type'] == 'image' %}<image>"
               "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}{% endmacro %}")


def with_image_parts(template: str) -> str:
    """A text model's chat template that also renders list contents (image parts as `<image>`, IMAGE_PARTS): every
    `message['content']` it writes goes through the macro; a string content renders exactly as before. ValueError
    when the template writes no `message['content']`."""
    if "message['content']" not in template:
        raise ValueError("the chat template writes no message['content'], so image parts cannot be added to it")
    return IMAGE_PARTS + template.replace("message['content']", "image_parts(message['content'])")


def character_tokenizer(special_tokens: list[str], **roles: str) -> Any:
    """rft.models.tiny's character tokenizer (newlines are pieces too) plus `special_tokens`, as a transformers
    fast tokenizer; `roles` overrides the pad/eos/bos/unk tokens."""
    from tokenizers import Regex, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tokenizer = build_tokenizer()
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex("[\\s\\S]"), behavior="isolated")
    tokenizer.add_special_tokens(special_tokens)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, **{
        "pad_token": "<pad>", "eos_token": "<eos>", "bos_token": "<bos>", "unk_token": "<pad>", **roles})


def image_seq_len(image_size: int, patch_size: int, scale_factor: int) -> int:
    """Placeholder tokens per image (or tile): the patch grid's size over the pixel shuffle's factor squared."""
    return (image_size // patch_size) ** 2 // scale_factor ** 2


def tiny_idefics3_processor(*, image_size: int = 32, patch_size: int = 8, scale_factor: int = 2,
                            longest_edge: int | None = None) -> Any:
    """The tiny model's processor alone (in memory; module docstring): no image splitting, or with `longest_edge`
    images resized to it and split into `image_size` tiles."""
    return idefics3_processor(character_tokenizer(IMAGE_TOKENS), CHAT_TEMPLATE, image_size=image_size,
                              patch_size=patch_size, scale_factor=scale_factor, longest_edge=longest_edge)


def idefics3_processor(tokenizer: Any, chat_template: str, *, image_size: int, patch_size: int, scale_factor: int,
                       longest_edge: int | None = None) -> Any:
    """transformers' `Idefics3Processor` over `tokenizer` (which has IMAGE_TOKENS) with the PIL image processor
    (SigLIP's normalisation): images resized to `image_size` square, `image_seq_len(...)` placeholders each; with
    `longest_edge`, resized to that and split into `image_size` tiles plus a global view."""
    from transformers import Idefics3ImageProcessorPil, Idefics3Processor

    tile = {"longest_edge": image_size}
    image_processor = Idefics3ImageProcessorPil(
        do_resize=True, size={"longest_edge": longest_edge or image_size}, do_image_splitting=longest_edge is not None,
        max_image_size=tile, image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5])
    return Idefics3Processor(image_processor=image_processor, tokenizer=tokenizer,
                             image_seq_len=image_seq_len(image_size, patch_size, scale_factor),
                             chat_template=chat_template)


def vision_config(*, hidden_size: int, layers: int, heads: int, image_size: int, patch_size: int) -> dict[str, Any]:
    """An Idefics3 (SigLIP) vision tower's config: MLP width twice the hidden size."""
    return dict(hidden_size=hidden_size, intermediate_size=2 * hidden_size, num_hidden_layers=layers,
                num_attention_heads=heads, image_size=image_size, patch_size=patch_size)


def make_tiny_idefics3(out_dir: str | Path, *, image_size: int = 32, patch_size: int = 8, scale_factor: int = 2,
                       longest_edge: int | None = None, vision_hidden_size: int = 32, vision_layers: int = 2,
                       vision_heads: int = 2, hidden_size: int = 128, layers: int = 2, heads: int = 4,
                       kv_heads: int = 2, intermediate_size: int = 256, tie_word_embeddings: bool = False,
                       seed: int = 0) -> Path:
    """Write a tiny Idefics3ForConditionalGeneration directory (weights, tokenizer, processor) and return its path.
    The text model's head_dim (hidden_size / heads, 32 by default) is one vLLM's CPU attention takes."""
    import torch
    from transformers import Idefics3Config, Idefics3ForConditionalGeneration

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    processor = tiny_idefics3_processor(image_size=image_size, patch_size=patch_size, scale_factor=scale_factor,
                                        longest_edge=longest_edge)
    fast = processor.tokenizer
    config = Idefics3Config(
        vision_config=vision_config(hidden_size=vision_hidden_size, layers=vision_layers, heads=vision_heads,
                                    image_size=image_size, patch_size=patch_size),
        text_config=dict(model_type="llama", vocab_size=len(fast), hidden_size=hidden_size,
                         intermediate_size=intermediate_size, num_hidden_layers=layers, num_attention_heads=heads,
                         num_key_value_heads=kv_heads, rms_norm_eps=1e-6, max_position_embeddings=512,
                         tie_word_embeddings=tie_word_embeddings, bos_token_id=2, eos_token_id=1, pad_token_id=0,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
        scale_factor=scale_factor, image_token_id=fast.convert_tokens_to_ids("<image>"), pad_token_id=0,
        tie_word_embeddings=tie_word_embeddings, architectures=["Idefics3ForConditionalGeneration"])
    torch.manual_seed(seed)
    model = Idefics3ForConditionalGeneration(config).eval()  # float32: torch's default dtype
    return save_tiny(out, model, [processor], "idefics3", seed)


def tiny_qwen2_5_vl_parts(*, patch_size: int = 8, merge_size: int = 2, temporal_patch_size: int = 2,
                          min_pixels: int = 32 * 32, max_pixels: int = 64 * 64) -> tuple[Any, Any]:
    """The tiny Qwen2.5-VL's tokenizer (chat template set) and PIL image processor (module docstring), in memory."""
    from transformers import Qwen2VLImageProcessorPil

    fast = character_tokenizer(QWEN_VL_TOKENS, eos_token="<|im_end|>")
    fast.chat_template = QWEN_VL_CHAT_TEMPLATE
    image_processor = Qwen2VLImageProcessorPil(
        min_pixels=min_pixels, max_pixels=max_pixels, patch_size=patch_size, merge_size=merge_size,
        temporal_patch_size=temporal_patch_size)
    return fast, image_processor


def make_tiny_qwen2_5_vl(out_dir: str | Path, *, patch_size: int = 8, merge_size: int = 2,
                         temporal_patch_size: int = 2, min_pixels: int = 32 * 32, max_pixels: int = 64 * 64,
                         window_size: int = 32, vision_hidden_size: int = 32, vision_layers: int = 2,
                         vision_heads: int = 2, fullatt_block_indexes: tuple[int, ...] = (1,), hidden_size: int = 128,
                         layers: int = 2, heads: int = 4, kv_heads: int = 2, intermediate_size: int = 256,
                         mrope_section: tuple[int, int, int] = (4, 6, 6), tie_word_embeddings: bool = False,
                         seed: int = 0) -> Path:
    """Write a tiny Qwen2_5_VLForConditionalGeneration directory (weights, config, tokenizer with its chat template,
    preprocessor_config.json) and return its path. `mrope_section` sums to half the text head_dim (32 by default,
    one vLLM's CPU attention takes); `window_size` is in pixels (32: windows of 2x2 merged tokens)."""
    import torch
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    if 2 * sum(mrope_section) != hidden_size // heads:
        raise ValueError(f"mrope_section {list(mrope_section)} must sum to half the head_dim "
                         f"({hidden_size // heads})")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    fast, image_processor = tiny_qwen2_5_vl_parts(patch_size=patch_size, merge_size=merge_size,
                                                  temporal_patch_size=temporal_patch_size, min_pixels=min_pixels,
                                                  max_pixels=max_pixels)
    ids = {name: fast.convert_tokens_to_ids(token) for name, token in (
        ("image_token_id", "<|image_pad|>"), ("video_token_id", "<|video_pad|>"),
        ("vision_start_token_id", "<|vision_start|>"), ("vision_end_token_id", "<|vision_end|>"))}
    eos = fast.convert_tokens_to_ids("<|im_end|>")
    config = Qwen2_5_VLConfig(
        vision_config=dict(depth=vision_layers, hidden_size=vision_hidden_size,
                           intermediate_size=2 * vision_hidden_size, num_heads=vision_heads, patch_size=patch_size,
                           spatial_merge_size=merge_size, temporal_patch_size=temporal_patch_size,
                           window_size=window_size,
                           out_hidden_size=hidden_size, fullatt_block_indexes=list(fullatt_block_indexes)),
        text_config=dict(vocab_size=len(fast), hidden_size=hidden_size, intermediate_size=intermediate_size,
                         num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                         rms_norm_eps=1e-6, max_position_embeddings=512, tie_word_embeddings=tie_word_embeddings,
                         bos_token_id=2, eos_token_id=eos, pad_token_id=0,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                          "mrope_section": list(mrope_section)}),
        **ids, tie_word_embeddings=tie_word_embeddings, architectures=["Qwen2_5_VLForConditionalGeneration"])
    torch.manual_seed(seed)
    model = Qwen2_5_VLForConditionalGeneration(config).eval()  # float32: torch's default dtype
    return save_tiny(out, model, [fast, image_processor], "qwen2_5_vl", seed)
