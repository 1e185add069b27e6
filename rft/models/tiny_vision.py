"""A tiny seeded Idefics3 (SmolVLM's architecture: a SigLIP vision tower, a pixel-shuffle connector, a Llama decoder)
in Hugging Face format with its processor, for the engine and serve tests. Nothing is downloaded.

The tokenizer is rft.models.tiny's character-level one plus Idefics3's image tokens (`<image>`,
`<fake_token_around_image>`, `<global-img>`, `<row_i_col_j>`, `<end_of_utterance>`) and a small chat template that
renders image parts as `<image>`. Images: 32-pixel tiles of 8-pixel patches, pixel-shuffled by 2: 4 image tokens per
tile; an image larger than 32 pixels is split into tiles plus a global view (up to `longest_edge`).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rft.models.tiny import SPECIAL_TOKENS, build_tokenizer

IMAGE_TOKENS = (["<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>"]
                + [f"<row_{i}_col_{j}>" for i in range(1, 7) for j in range(1, 7)])
# user turns: image parts as <image>, text as is; each turn ends with <end_of_utterance>
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] | capitalize }}:"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}{% if part['type'] == 'image' %}<image>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
    "<end_of_utterance>\n{% endfor %}{% if add_generation_prompt %}Assistant:{% endif %}")


def make_tiny_idefics3(out_dir: str | Path, *, hidden_size: int = 128, layers: int = 2, heads: int = 4,
                       kv_heads: int = 2, vision_hidden_size: int = 32, vision_layers: int = 1, tile: int = 32,
                       patch: int = 8, longest_edge: int = 64, seed: int = 0) -> Path:
    """Write a tiny Idefics3 model directory (weights, tokenizer, processor) and return its path. The text model's
    head_dim (hidden_size / heads) must be one vLLM's CPU attention supports (32)."""
    import torch
    from transformers import Idefics3Config, Idefics3ForConditionalGeneration

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    processor = tiny_idefics3_processor(tile=tile, patch=patch, longest_edge=longest_edge)
    fast = processor.tokenizer
    vocab = len(fast)
    text = dict(model_type="llama", vocab_size=vocab, hidden_size=hidden_size, num_hidden_layers=layers,
                num_attention_heads=heads, num_key_value_heads=kv_heads, intermediate_size=2 * hidden_size,
                max_position_embeddings=512, rms_norm_eps=1e-6, bos_token_id=2, eos_token_id=1, pad_token_id=0,
                tie_word_embeddings=False)
    vision = dict(hidden_size=vision_hidden_size, intermediate_size=2 * vision_hidden_size,
                  num_hidden_layers=vision_layers, num_attention_heads=2, image_size=tile, patch_size=patch)
    config = Idefics3Config(text_config=text, vision_config=vision, scale_factor=2,
                            image_token_id=fast.convert_tokens_to_ids("<image>"), pad_token_id=0,
                            tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = Idefics3ForConditionalGeneration(config).eval()
    model.save_pretrained(out, safe_serialization=True)
    processor.save_pretrained(out)
    tok_config = out / "tokenizer_config.json"
    tok_config.write_text(json.dumps({**json.loads(tok_config.read_text()),
                                      "tokenizer_class": "PreTrainedTokenizerFast"}, indent=2) + "\n")
    (out / "rft_tiny_model.json").write_text(json.dumps({"arch": "idefics3", "seed": seed}) + "\n")
    return out


def tiny_idefics3_processor(*, tile: int = 32, patch: int = 8, longest_edge: int = 64) -> Any:
    """The tiny model's processor alone (in memory): the character tokenizer with Idefics3's image tokens, the PIL
    image processor (images resized to `longest_edge`, split into `tile`-pixel tiles), 4 image tokens a tile."""
    from tokenizers import Regex, pre_tokenizers
    from transformers import Idefics3ImageProcessorPil, Idefics3Processor, PreTrainedTokenizerFast

    tokenizer = build_tokenizer()
    # every character its own piece, newlines too (the processor writes "\n\n" between an image's rows and its
    # global view, which "." alone would leave as one unknown piece)
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex("[\\s\\S]"), behavior="isolated")
    tokenizer.add_special_tokens(IMAGE_TOKENS)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", eos_token="<eos>",
                                   bos_token="<bos>", unk_token="<pad>")
    image_processor = Idefics3ImageProcessorPil(
        do_resize=True, size={"longest_edge": longest_edge}, do_image_splitting=True,
        max_image_size={"longest_edge": tile}, image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5])
    seq_len = (tile // patch) ** 2 // 4  # patches per tile, pixel-shuffled by a scale factor of 2
    return Idefics3Processor(image_processor=image_processor, tokenizer=fast, image_seq_len=seq_len,
                             chat_template=CHAT_TEMPLATE)


__all__ = ["CHAT_TEMPLATE", "IMAGE_TOKENS", "SPECIAL_TOKENS", "make_tiny_idefics3", "tiny_idefics3_processor"]
