"""Tiny seeded models in Hugging Face format, for tests, benchmarks and the CPU quickstart.

A character-level tokenizer (built with `tokenizers`, saved as `tokenizer.json`) and a randomly
initialised model with grouped-query attention: dense Qwen2, Llama or Qwen3 (q/k RMSNorm, explicit
`head_dim`), or a mixture of experts, Qwen3-MoE or Qwen2-MoE (with a gated shared expert). Same seed,
same bytes. Nothing is downloaded from a hub.
"""
from __future__ import annotations

import argparse
import json
import string
from pathlib import Path
from typing import Any, TypedDict

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


ARCHITECTURES = ("qwen2", "llama", "qwen3", "qwen3_moe", "qwen2_moe")
MOE_ARCHITECTURES = ("qwen3_moe", "qwen2_moe")


class _Common(TypedDict):
    """The keyword arguments every architecture's transformers config takes here."""
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    tie_word_embeddings: bool
    max_position_embeddings: int
    rms_norm_eps: float
    rope_parameters: dict[str, str | float]
    bos_token_id: int
    eos_token_id: int
    pad_token_id: int
    dtype: str


class _Experts(TypedDict):
    """The mixture-of-experts keyword arguments of the qwen3_moe and qwen2_moe configs."""
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    norm_topk_prob: bool
    mlp_only_layers: list[int]
    decoder_sparse_step: int


def make_tiny_model(out_dir: str | Path, *, arch: str = "qwen2", hidden_size: int = 128, layers: int = 2,
                    heads: int = 4, kv_heads: int = 2, intermediate_size: int = 256,
                    tie_word_embeddings: bool = True, vocab_size: int | None = None, seed: int = 0,
                    max_position_embeddings: int = 512, head_dim: int | None = None, experts: int = 4,
                    experts_per_token: int = 2, moe_intermediate_size: int = 64, norm_topk_prob: bool = True,
                    mlp_only_layers: tuple[int, ...] = (), shared_expert_intermediate_size: int = 128,
                    llama3_rope_factor: float = 0.0) -> Path:
    """Write a tiny HF model directory and return its path. `vocab_size` above the tokenizer's size
    leaves unused rows (useful to exercise vocabulary padding).

    `head_dim` (qwen3, qwen3_moe; default hidden_size / heads) may differ from hidden_size / heads. The MoE
    architectures take `experts` routed experts of `moe_intermediate_size`, `experts_per_token` of them per
    token, `norm_topk_prob` (renormalise the chosen experts' weights), `mlp_only_layers` (layer indices with a
    dense MLP of `intermediate_size` instead) and, for qwen2_moe, a shared expert of
    `shared_expert_intermediate_size` with its sigmoid gate. `llama3_rope_factor` > 0 (llama): Llama 3.x rope
    scaling (`rope_type: llama3`, the low/high frequency factors 1 and 4 and 8192 original positions of Llama 3)."""
    import torch
    from transformers import (
        AutoModelForCausalLM,
        LlamaConfig,
        PretrainedConfig,
        PreTrainedTokenizerFast,
        Qwen2Config,
        Qwen2MoeConfig,
        Qwen3Config,
        Qwen3MoeConfig,
    )

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    n_tokens = tokenizer.get_vocab_size()
    vocab_size = vocab_size or n_tokens
    if vocab_size < n_tokens:
        raise ValueError(f"vocab_size {vocab_size} is smaller than the tokenizer's {n_tokens} tokens")
    common = _Common(vocab_size=vocab_size, hidden_size=hidden_size, num_hidden_layers=layers,
                     num_attention_heads=heads, num_key_value_heads=kv_heads, intermediate_size=intermediate_size,
                     tie_word_embeddings=tie_word_embeddings, max_position_embeddings=max_position_embeddings,
                     rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                     bos_token_id=2, eos_token_id=1, pad_token_id=0, dtype="float32")
    moe = _Experts(num_experts=experts, num_experts_per_tok=experts_per_token,
                   moe_intermediate_size=moe_intermediate_size, norm_topk_prob=norm_topk_prob,
                   mlp_only_layers=list(mlp_only_layers), decoder_sparse_step=1)
    config: PretrainedConfig
    if arch == "qwen2":
        config = Qwen2Config(**common, use_sliding_window=False)
    elif arch == "llama":
        config = LlamaConfig(**common, attention_bias=False, mlp_bias=False)
        if llama3_rope_factor:
            config.rope_parameters = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": llama3_rope_factor,
                                      "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                      "original_max_position_embeddings": 8192}
            config.max_position_embeddings = max(max_position_embeddings, 16384)  # above the original 8192
    elif arch == "qwen3":
        config = Qwen3Config(**common, head_dim=head_dim or hidden_size // heads, use_sliding_window=False)
    elif arch == "qwen3_moe":
        # head_dim is one of the extra keywords Qwen3MoeConfig's generated __init__ passes on undeclared (its model
        # reads config.head_dim); the stub lists only the declared ones
        config = Qwen3MoeConfig(**common, **moe, head_dim=head_dim or hidden_size // heads,  # type: ignore[call-arg]
                                use_sliding_window=False)
    elif arch == "qwen2_moe":
        config = Qwen2MoeConfig(**common, **moe, shared_expert_intermediate_size=shared_expert_intermediate_size,
                                use_sliding_window=False)
    else:
        raise ValueError(f"unknown tiny-model architecture {arch!r} ({', '.join(ARCHITECTURES)})")
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", eos_token="<eos>",
                                   bos_token="<bos>", unk_token="<pad>")
    fast.chat_template = None
    return save_tiny(out, model, [fast], arch, seed)


def save_tiny(out: Path, model: Any, parts: list[Any], arch: str, seed: int) -> Path:
    """Write a tiny model, its tokenizer / processor `parts`, the tokenizer class every loader knows (for a qwen2
    config transformers' AutoTokenizer would otherwise pick Qwen2Tokenizer, whose byte-level pre-tokenizer drops
    spaces and newlines of a character vocabulary) and the maker's marker (`rft_tiny_model.json`); `out`."""
    model.save_pretrained(out, safe_serialization=True)
    for part in parts:
        part.save_pretrained(out)
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
    parser.add_argument("--arch", choices=ARCHITECTURES, default="qwen2")
    parser.add_argument("--hidden-size", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--experts", type=int, default=4, help="routed experts (qwen3_moe, qwen2_moe)")
    parser.add_argument("--experts-per-token", type=int, default=2, help="experts each token is routed to")
    parser.add_argument("--max-position-embeddings", type=int, default=512,
                        help="longest prompt + response the model takes (rope positions)")
    parser.add_argument("--untied", action="store_true", help="separate output layer")
    parser.add_argument("--seed", type=int, default=0)
    a = parser.parse_args(argv)
    path = make_tiny_model(a.out_dir, arch=a.arch, hidden_size=a.hidden_size, layers=a.layers, heads=a.heads,
                           kv_heads=a.kv_heads, tie_word_embeddings=not a.untied, seed=a.seed,
                           experts=a.experts, experts_per_token=a.experts_per_token,
                           max_position_embeddings=a.max_position_embeddings)
    print(path)
    return 0
