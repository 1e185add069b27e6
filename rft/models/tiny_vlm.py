"""A tiny seeded Idefics3 (SmolVLM's architecture: a SigLIP vision tower, the pixel-shuffle connector, a Llama text
model) in Hugging Face format with its processor, for tests of the bridge, the engines and serve: randomly
initialised, same seed, same bytes; nothing downloaded.

The tokenizer is rft.models.tiny's character tokenizer (every character its own piece, newlines too: the processor
writes "\\n\\n" between an image's rows and its global view) plus Idefics3's image tokens (`<fake_token_around_image>`,
`<image>`, `<end_of_utterance>`, `<global-img>`, `<row_i_col_j>`), and a small chat template that renders image parts
as `<image>`. The processor is transformers' `Idefics3Processor` with its PIL image processor: each image is resized
to `image_size` pixels square and gives `image_seq_len(...)` placeholders (4 by default), or, with `longest_edge`,
resized to that and split into `image_size` tiles plus a global view, as SmolVLM does.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rft.models.tiny import build_tokenizer

IMAGE_TOKENS = (["<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>"]
                + [f"<row_{i}_col_{j}>" for i in range(1, 7) for j in range(1, 7)])
# a jinja macro rendering a message's content: a string as is, or its parts in order, image parts as <image> and text
# parts as their text
IMAGE_PARTS = ("{% macro image_parts(content) %}{% if content is string %}{{ content }}{% else %}"
               "{% for part in content %}{% if part['type'] == 'image' %}<image>"
               "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}{% endmacro %}")
# user turns: image parts as <image>, text as is; each turn ends with <end_of_utterance>
CHAT_TEMPLATE = (IMAGE_PARTS + "{% for message in messages %}{{ message['role'] | capitalize }}:"
                 "{{ image_parts(message['content']) }}<end_of_utterance>\n{% endfor %}"
                 "{% if add_generation_prompt %}Assistant:{% endif %}")


def with_image_parts(template: str) -> str:
    """A text model's chat template that also renders list contents (image parts as `<image>`, IMAGE_PARTS): every
    `message['content']` it writes goes through the macro; a string content renders exactly as before. ValueError
    when the template writes no `message['content']`."""
    if "message['content']" not in template:
        raise ValueError("the chat template writes no message['content'], so image parts cannot be added to it")
    return IMAGE_PARTS + template.replace("message['content']", "image_parts(message['content'])")

def image_seq_len(image_size: int, patch_size: int, scale_factor: int) -> int:
    """Placeholder tokens per image (or tile): the patch grid's size over the pixel shuffle's factor squared."""
    return (image_size // patch_size) ** 2 // scale_factor ** 2


def tiny_idefics3_processor(*, image_size: int = 32, patch_size: int = 8, scale_factor: int = 2,
                            longest_edge: int | None = None) -> Any:
    """The tiny model's processor alone (in memory; module docstring): no image splitting, or with `longest_edge`
    images resized to it and split into `image_size` tiles."""
    from tokenizers import Regex, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tokenizer = build_tokenizer()
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex("[\\s\\S]"), behavior="isolated")
    tokenizer.add_special_tokens(IMAGE_TOKENS)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", eos_token="<eos>",
                                   bos_token="<bos>", unk_token="<pad>")
    return idefics3_processor(fast, CHAT_TEMPLATE, image_size=image_size, patch_size=patch_size,
                              scale_factor=scale_factor, longest_edge=longest_edge)


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
    model.save_pretrained(out, safe_serialization=True)
    processor.save_pretrained(out)
    tok_config = out / "tokenizer_config.json"
    tok_config.write_text(json.dumps({**json.loads(tok_config.read_text()),
                                      "tokenizer_class": "PreTrainedTokenizerFast"}, indent=2) + "\n")
    (out / "rft_tiny_model.json").write_text(json.dumps({"arch": "idefics3", "seed": seed}) + "\n")
    return out
