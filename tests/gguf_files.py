"""Small GGUF files written by the tests themselves, the way llama.cpp's `convert_hf_to_gguf.py` writes them.

`write_gguf(hf_dir, path)` turns a tiny HF model (rft.models.tiny) into a GGUF with the metadata and tensor names
transformers' GGUF loader reads: `{arch}.*` hyperparameters, tensors named by gguf's own name map (`blk.N.attn_q`,
...), llama's q/k rows permuted as llama.cpp permutes them (transformers undoes it on load), no `output.weight`
when the embeddings are tied, and a byte-level BPE tokenizer (`tokenizer.ggml.model = gpt2`) with its merges,
special tokens marked CONTROL and a ChatML chat template. The tokenizer is trained with `tokenizers` on a fixed
text, so the same arguments give the same bytes. Two-dimensional weights can be stored quantized (Q8_0, Q4_1),
so that the import exercises transformers' dequantization.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2 as in SmolLM2
CHAT_TEMPLATE = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] "
                 "+ '<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
                 "{% endif %}")
CORPUS = ["What is 17 + 25? The answer is 42.", "The quick brown fox jumps over the lazy dog.",
          "Count the legs: a dog has four legs and a bird has two.", "Hello world, hello there!\n"] * 20


def train_tokenizer(vocab_size: int = 320):
    """A byte-level BPE tokenizer (`tokenizers`), special tokens first."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(CORPUS, trainer)
    return tokenizer


def tokenizer_tables(tokenizer) -> tuple[list[str], list[str]]:
    """(tokens by id, merges as 'a b') of a BPE tokenizer."""
    vocab = tokenizer.get_vocab()
    tokens = sorted(vocab, key=vocab.get)
    assert [vocab[t] for t in tokens] == list(range(len(tokens))), "token ids are not contiguous"
    merges = json.loads(tokenizer.to_str())["model"]["merges"]
    return tokens, [m if isinstance(m, str) else " ".join(m) for m in merges]


def llama_permute(weights: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's row permutation of q/k (`LlamaModel.permute`): rotary halves interleaved per head."""
    return (weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
            .swapaxes(1, 2).reshape(weights.shape))


def write_gguf(hf_dir: str | Path, path: str | Path, *, tokenizer, quantize: str | None = "Q8_0",
               architecture: str | None = None) -> Path:
    """Write the HF model at `hf_dir` (llama or qwen2, vocabulary = `tokenizer`'s) as the GGUF `path`.
    `quantize` stores every 2-D weight in that ggml type (None: float32); `architecture` overrides
    `general.architecture` (to write a file of an unsupported kind)."""
    import gguf
    from safetensors.numpy import load_file

    config = json.loads((Path(hf_dir) / "config.json").read_text())
    arch = config["model_type"]
    heads, kv_heads, layers = config["num_attention_heads"], config["num_key_value_heads"], config["num_hidden_layers"]
    tokens, merges = tokenizer_tables(tokenizer)
    if len(tokens) != config["vocab_size"]:
        raise ValueError(f"tokenizer has {len(tokens)} tokens, the model {config['vocab_size']}")
    writer = gguf.GGUFWriter(str(path), architecture or arch)
    writer.add_name(f"tiny-{arch}")
    writer.add_vocab_size(config["vocab_size"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(layers)
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_dimension_count(config["hidden_size"] // heads)
    writer.add_rope_freq_base(config.get("rope_parameters", {}).get("rope_theta", config.get("rope_theta")))
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_file_type(gguf.LlamaFileType.ALL_F32 if quantize is None else gguf.LlamaFileType[f"MOSTLY_{quantize}"])
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2" if arch == "qwen2" else "smollm")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.CONTROL if t in SPECIAL_TOKENS else gguf.TokenType.NORMAL
                            for t in tokens])
    writer.add_token_merges(merges)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_pad_token_id(2)
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHAT_TEMPLATE)

    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA if arch == "llama" else gguf.MODEL_ARCH.QWEN2, layers)
    qtype = gguf.GGMLQuantizationType.F32 if quantize is None else gguf.GGMLQuantizationType[quantize]
    for hf_name, weights in sorted(load_file(str(Path(hf_dir) / "model.safetensors")).items()):
        if hf_name == "lm_head.weight" and config["tie_word_embeddings"]:
            continue  # llama.cpp writes no output.weight for tied embeddings
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if name is None:
            raise ValueError(f"no GGUF name for {hf_name}")
        weights = weights.astype(np.float32)
        if arch == "llama" and hf_name.endswith("q_proj.weight"):
            weights = llama_permute(weights, heads)
        elif arch == "llama" and hf_name.endswith("k_proj.weight"):
            weights = llama_permute(weights, kv_heads)
        if weights.ndim == 2 and qtype != gguf.GGMLQuantizationType.F32:
            writer.add_tensor(name, gguf.quants.quantize(weights, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(name, weights)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(path)


def tiny_gguf(tmp_path: Path, *, arch: str, quantize: str | None = "Q8_0", architecture: str | None = None,
              tie_word_embeddings: bool = True) -> Path:
    """A tiny seeded `arch` model written as `tmp_path/tiny-{arch}.gguf`."""
    from rft.models.tiny import make_tiny_model

    tokenizer = train_tokenizer()
    hf_dir = make_tiny_model(tmp_path / f"hf-{arch}", arch=arch, vocab_size=tokenizer.get_vocab_size(),
                             tie_word_embeddings=tie_word_embeddings)
    return write_gguf(hf_dir, tmp_path / f"tiny-{arch}.gguf", tokenizer=tokenizer, quantize=quantize,
                      architecture=architecture)
