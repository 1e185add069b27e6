"""Tiny seeded models in Hugging Face format, for tests, benchmarks and the CPU quickstart.

A character-level tokenizer (built with `tokenizers`, saved as `tokenizer.json`) and a randomly
initialised Qwen2 (or Llama) model with grouped-query attention. Same seed, same bytes. Nothing is
downloaded from a hub.
"""
from __future__ import annotations

import argparse
import json
import string
from pathlib import Path

SPECIAL_TOKENS = ["<pad>", "<eos>", "<bos>"]
CHARACTERS = list(string.digits + string.ascii_letters + string.punctuation + " \n")


def build_tokenizer():
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + CHARACTERS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(SPECIAL_TOKENS)
    return tok


def make_tiny_model(out_dir: str | Path, *, arch: str = "qwen2", hidden_size: int = 128, layers: int = 2,
                    heads: int = 4, kv_heads: int = 2, intermediate_size: int = 256,
                    tie_word_embeddings: bool = True, vocab_size: int | None = None, seed: int = 0,
                    max_position_embeddings: int = 512) -> Path:
    """Write a tiny HF model directory and return its path. `vocab_size` above the tokenizer's size
    leaves unused rows (useful to exercise vocabulary padding)."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast, Qwen2Config

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    n_tokens = tokenizer.get_vocab_size()
    vocab_size = vocab_size or n_tokens
    if vocab_size < n_tokens:
        raise ValueError(f"vocab_size {vocab_size} is smaller than the tokenizer's {n_tokens} tokens")
    common = dict(vocab_size=vocab_size, hidden_size=hidden_size, num_hidden_layers=layers,
                  num_attention_heads=heads, num_key_value_heads=kv_heads, intermediate_size=intermediate_size,
                  tie_word_embeddings=tie_word_embeddings, max_position_embeddings=max_position_embeddings,
                  rms_norm_eps=1e-6, rope_theta=10000.0, bos_token_id=2, eos_token_id=1, pad_token_id=0,
                  dtype="float32")
    if arch == "qwen2":
        config = Qwen2Config(**common, use_sliding_window=False)
    elif arch == "llama":
        config = LlamaConfig(**common, attention_bias=False, mlp_bias=False)
    else:
        raise ValueError(f"unknown tiny-model architecture {arch!r} (qwen2 or llama)")
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(out, safe_serialization=True)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", eos_token="<eos>",
                                   bos_token="<bos>", unk_token="<pad>")
    fast.chat_template = None
    fast.save_pretrained(out)
    # Keep transformers' AutoTokenizer on this exact tokenizer (for a qwen2 config it would otherwise pick
    # Qwen2Tokenizer, whose byte-level pre-tokenizer drops spaces and newlines of a character vocabulary).
    tok_config = out / "tokenizer_config.json"
    tok_config.write_text(json.dumps({**json.loads(tok_config.read_text()),
                                      "tokenizer_class": "PreTrainedTokenizerFast"}, indent=2) + "\n")
    (out / "rft_tiny_model.json").write_text(json.dumps({"arch": arch, "seed": seed}) + "\n")
    return out

# head_dim = hidden_size / heads must be one that vLLM's CPU attention supports (32 works; 16 crashes
# the engine at start without a message), hence 128 / 4.


def main(argv: list[str]) -> int:
    """`rft tiny-model OUT_DIR`: write the model and print its path."""
    parser = argparse.ArgumentParser(prog="rft tiny-model", description="Write a tiny seeded HF model.")
    parser.add_argument("out_dir")
    parser.add_argument("--arch", choices=["qwen2", "llama"], default="qwen2")
    parser.add_argument("--hidden-size", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--untied", action="store_true", help="separate output layer")
    parser.add_argument("--seed", type=int, default=0)
    a = parser.parse_args(argv)
    path = make_tiny_model(a.out_dir, arch=a.arch, hidden_size=a.hidden_size, layers=a.layers, heads=a.heads,
                           kv_heads=a.kv_heads, tie_word_embeddings=not a.untied, seed=a.seed)
    print(path)
    return 0
