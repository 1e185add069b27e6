"""Qwen2 / Qwen2.5 (Qwen2ForCausalLM) <-> megatron GPTModel: Llama's table plus the QKV bias."""
from __future__ import annotations

from megatron_bridge.mapping import QKV
from megatron_bridge.models.base import DecoderBridge, register
from megatron_bridge.models.llama import LLAMA_TABLE

QWEN2_TABLE = LLAMA_TABLE + (
    QKV(q="model.layers.*.self_attn.q_proj.bias", k="model.layers.*.self_attn.k_proj.bias",
        v="model.layers.*.self_attn.v_proj.bias", megatron="decoder.layers.*.self_attention.linear_qkv.bias"),
)


@register("Qwen2ForCausalLM")
class Qwen2Bridge(DecoderBridge):
    """Qwen2 and Qwen2.5 dense models (bias on q/k/v only); sliding-window attention is refused."""

    qkv_bias = True
    mapping_table = QWEN2_TABLE

    def unsupported_options(self) -> list[str]:
        return super().unsupported_options() + window_refusals(self.hf)


def window_refusals(hf) -> list[str]:
    """Sliding-window attention (Qwen2, Qwen3 and their MoE): megatron's causal attention has no window."""
    problems = []
    if getattr(hf, "use_sliding_window", False):
        problems.append("use_sliding_window=True (megatron's causal attention has no window)")
    layer_types = set(getattr(hf, "layer_types", None) or ["full_attention"])
    if layer_types != {"full_attention"}:
        problems.append(f"layer_types={sorted(layer_types)} (only full_attention)")
    return problems
