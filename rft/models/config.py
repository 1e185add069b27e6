"""The `model` section: the model every part starts from, its lengths and chat formatting, and LoRA training."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from rft.config import POSITIVE, Range, Section, SectionError, at_least, option, section

LORA_TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")  # megatron_bridge.lora.TARGETS
CHAT_TEMPLATE_FILES = ("chat_template.jinja", "chat_template.json")  # where transformers saves a template

TOKENS = Range(1, 10_000_000, note="tokens; 10 million is beyond any model's context")


@dataclass(frozen=True)
class LoraConfig(Section):
    """`model.lora`: train LoRA adapters instead of the whole model (megatron_bridge/lora.py); each version is then
    a PEFT adapter (adapter_config.json, adapter_model.safetensors), not the model."""
    KEY = "model.lora"
    rank: int = option(0, help="adapter rank r; 0: off (full fine-tuning)", range=at_least(0, "0: off"))
    alpha: float = option(32.0, range=POSITIVE,
        help="the adapters' output is scaled by alpha / rank (PEFT's lora_alpha)")
    dropout: float = option(0.0, range=Range(0, 1, high_open=True),
        help="dropout probability on each adapter's input while training (PEFT's lora_dropout), in [0, 1)")
    target_modules: list[str] = option(factory=lambda: list(LORA_TARGETS),
        help="megatron linears that get adapters: linear_qkv (HF q_proj, k_proj, v_proj: one A, shared), "
        "linear_proj (o_proj), linear_fc1 (gate_proj, up_proj: one A, shared), linear_fc2 (down_proj)")
    init_from: str = option("",
        help="a PEFT adapter directory to start from (its A shared as above); empty: A random, B zero")

    def validate(self) -> None:
        unknown = [t for t in self.target_modules if t not in LORA_TARGETS]
        if unknown or (self.rank and not self.target_modules):
            raise SectionError("target_modules", f"must be a non-empty list of {', '.join(LORA_TARGETS)}; "
                              f"got {self.target_modules}")


@dataclass(frozen=True)
class ModelConfig(Section):
    KEY = "model"
    path: str = option("",
        help="required: the Hugging Face model directory the trainer starts from and every engine loads first "
        "(version 0)")
    tokenizer: str = option("", help="empty: same as path")
    dtype: Literal["float32", "bfloat16", "float16"] = option("float32",
        help="parameter dtype of the trainer (bfloat16, float16: megatron's mixed precision) and of the engines; "
        "on a CPU, bfloat16 is fast only with avx512_bf16 or amx_bf16 (`rft run` says when it has them)")
    max_prompt_len: int = option(256, range=TOKENS,
        help="tokens: a task whose prompt is longer is not explored (dead-lettered) and `rft serve` refuses such a"
        " request (400)")
    max_response_len: int = option(64, range=TOKENS,
        help="tokens of one response (multi_turn, tool_agent: model and environment tokens together); caps "
        "explorer.max_tokens; the trainer cuts rows at max_prompt_len + max_response_len")
    chat_template: bool = option(False,
        help="format every task prompt through the tokenizer's chat template (docs/data.md)")
    system_prompt: str = option("", help="chat_template: the system turn before each prompt; empty: none")
    lora: LoraConfig = section(LoraConfig)


def chat_template_problem(model: ModelConfig) -> str | None:
    """Why `model.chat_template: true` cannot work with the tokenizer on disk (None when it can, or when the tokenizer
    is not on this machine to check)."""
    directory = Path(model.tokenizer or model.path)
    tokenizer_config = directory / "tokenizer_config.json"
    if not model.chat_template or not tokenizer_config.is_file():
        return None
    try:
        has_template = bool(json.loads(tokenizer_config.read_text()).get("chat_template"))
    except (OSError, json.JSONDecodeError) as e:
        return f"{tokenizer_config} is not readable JSON: {e}"
    if has_template or any((directory / name).is_file() for name in CHAT_TEMPLATE_FILES):
        return None
    return (f"the tokenizer in {directory} has no chat template (no chat_template in tokenizer_config.json, no "
            f"{' or '.join(CHAT_TEMPLATE_FILES)}): set model.chat_template: false, or use an instruct model's "
            f"tokenizer")
