"""Qwen3 dense (Qwen3ForCausalLM) <-> megatron GPTModel: Llama's table plus the per-head q/k RMSNorm."""
from __future__ import annotations

from megatron_bridge.mapping import Replicated
from megatron_bridge.models.base import DecoderBridge, register
from megatron_bridge.models.llama import LLAMA_TABLE
from megatron_bridge.models.qwen2 import window_refusals

QK_NORM_TABLE = (
    Replicated(hf="model.layers.*.self_attn.q_norm.weight",
               megatron="decoder.layers.*.self_attention.q_layernorm.weight"),
    Replicated(hf="model.layers.*.self_attn.k_norm.weight",
               megatron="decoder.layers.*.self_attention.k_layernorm.weight"),
)


def attention_refusals(bridge: DecoderBridge) -> list[str]:
    """Qwen3's attention options megatron's layer cannot reproduce."""
    problems = window_refusals(bridge.hf)
    if getattr(bridge.hf, "attention_bias", False):
        problems.append("attention_bias=True (biases on q/k/v/o are not mapped)")
    return problems


@register("Qwen3ForCausalLM")
class Qwen3Bridge(DecoderBridge):
    """Qwen3 dense models: no biases, RMSNorm on each head's query and key before RoPE, explicit head_dim
    (it may differ from hidden_size / heads); sliding-window attention is refused."""

    qk_layernorm = True
    mapping_table = LLAMA_TABLE + QK_NORM_TABLE

    def unsupported_options(self) -> list[str]:
        return super().unsupported_options() + attention_refusals(self)
