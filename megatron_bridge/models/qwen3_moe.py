"""Qwen3-MoE (Qwen3MoeForCausalLM) <-> megatron GPTModel: Qwen3's attention, routed experts (no shared one)."""
from __future__ import annotations

from megatron_bridge.models.base import register
from megatron_bridge.models.llama import LLAMA_TABLE
from megatron_bridge.models.moe import ROUTED_EXPERTS_TABLE, MoEBridge
from megatron_bridge.models.qwen3 import QK_NORM_TABLE, attention_refusals


@register("Qwen3MoeForCausalLM")
class Qwen3MoeBridge(MoEBridge):
    """Qwen3-MoE (e.g. Qwen3-30B-A3B): top-k softmax router with `norm_topk_prob`, dense layers where
    `mlp_only_layers` / `decoder_sparse_step` say; sliding-window attention is refused."""

    qk_layernorm = True
    mapping_table = LLAMA_TABLE + QK_NORM_TABLE + ROUTED_EXPERTS_TABLE

    def unsupported_options(self) -> list[str]:
        return super().unsupported_options() + attention_refusals(self)
