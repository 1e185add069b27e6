"""A tiny seeded Idefics3 (SmolVLM's architecture) in Hugging Face format, for tests: a SigLIP vision tower, the
pixel-shuffle connector and a Llama text model, randomly initialised; same seed, same bytes; nothing downloaded.

The tokenizer is rft.models.tiny's character tokenizer plus Idefics3's special tokens (`<fake_token_around_image>`,
`<image>`, `<global-img>`, `<end_of_utterance>`), and the directory holds an `Idefics3ImageProcessorPil` config (no
image splitting: each image is resized to `image_size` square, so it becomes `image_seq_len` placeholders) and an
`Idefics3Processor` config, so transformers' processor expands prompts for this model as for SmolVLM.
"""
from __future__ import annotations

import json
from pathlib import Path

from rft.models.tiny import build_tokenizer

IMAGE_TOKENS = ["<fake_token_around_image>", "<image>", "<global-img>", "<end_of_utterance>"]


def image_seq_len(image_size: int, patch_size: int, scale_factor: int) -> int:
    """Placeholder tokens per image: the patch grid's size over the pixel shuffle's factor squared."""
    return (image_size // patch_size) ** 2 // scale_factor ** 2


def make_tiny_idefics3(out_dir: str | Path, *, image_size: int = 32, patch_size: int = 8, scale_factor: int = 2,
                       vision_hidden_size: int = 32, vision_layers: int = 2, vision_heads: int = 2,
                       hidden_size: int = 128, layers: int = 2, heads: int = 4, kv_heads: int = 2,
                       intermediate_size: int = 256, tie_word_embeddings: bool = False, seed: int = 0) -> Path:
    """Write a tiny Idefics3ForConditionalGeneration directory and return its path. Each image gives
    `image_seq_len(image_size, patch_size, scale_factor)` features (4 by default). The text model's head_dim
    (hidden_size / heads, 32 by default) is one vLLM's CPU attention takes."""
    import torch
    from transformers import Idefics3Config, Idefics3ForConditionalGeneration, PreTrainedTokenizerFast
    from transformers.models.idefics3 import Idefics3ImageProcessorPil, Idefics3Processor

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    tokenizer.add_special_tokens(IMAGE_TOKENS)
    vocab = tokenizer.get_vocab()
    config = Idefics3Config(
        vision_config=dict(hidden_size=vision_hidden_size, intermediate_size=2 * vision_hidden_size,
                           num_hidden_layers=vision_layers, num_attention_heads=vision_heads, image_size=image_size,
                           patch_size=patch_size),
        text_config=dict(model_type="llama", vocab_size=tokenizer.get_vocab_size(), hidden_size=hidden_size,
                         intermediate_size=intermediate_size, num_hidden_layers=layers, num_attention_heads=heads,
                         num_key_value_heads=kv_heads, rms_norm_eps=1e-6, max_position_embeddings=512,
                         tie_word_embeddings=tie_word_embeddings, bos_token_id=2, eos_token_id=1, pad_token_id=0,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
        scale_factor=scale_factor, image_token_id=vocab["<image>"], pad_token_id=0,
        tie_word_embeddings=tie_word_embeddings, architectures=["Idefics3ForConditionalGeneration"])
    torch.manual_seed(seed)
    model = Idefics3ForConditionalGeneration(config)  # float32: torch's default dtype
    model.save_pretrained(out, safe_serialization=True)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", eos_token="<eos>",
                                   bos_token="<bos>", unk_token="<pad>")
    size = {"longest_edge": image_size}
    processor = Idefics3Processor(
        Idefics3ImageProcessorPil(do_image_splitting=False, size=size, max_image_size=size), fast,
        image_seq_len=image_seq_len(image_size, patch_size, scale_factor))
    processor.save_pretrained(out)
    tok_config = out / "tokenizer_config.json"
    tok_config.write_text(json.dumps({**json.loads(tok_config.read_text()),
                                      "tokenizer_class": "PreTrainedTokenizerFast"}, indent=2) + "\n")
    (out / "rft_tiny_model.json").write_text(json.dumps({"arch": "idefics3", "seed": seed}) + "\n")
    return out
