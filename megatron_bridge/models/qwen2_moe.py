"""Qwen2-MoE (Qwen2MoeForCausalLM) <-> megatron GPTModel: Qwen2's attention (q/k/v bias), routed experts and
one shared expert scaled by a sigmoid gate (megatron's `SharedExpertMLP` with `moe_shared_expert_gate`).

The MoE with a shared expert chosen for rft: transformers and vLLM both run it, and megatron-core has the
gated shared expert as is; DeepSeek-V2/V3 would also need multi-latent attention and group-limited routing
with a score correction bias, more surface to verify for the same feature.
"""
from __future__ import annotations

from typing import Any

from megatron_bridge.mapping import GatedMLP, Replicated, RowParallel
from megatron_bridge.models.base import register
from megatron_bridge.models.moe import ROUTED_EXPERTS_TABLE, MoEBridge
from megatron_bridge.models.qwen2 import QWEN2_TABLE, window_refusals

SHARED_EXPERT_TABLE = (
    GatedMLP(gate="model.layers.*.mlp.shared_expert.gate_proj.weight",
             up="model.layers.*.mlp.shared_expert.up_proj.weight",
             megatron="decoder.layers.*.mlp.shared_experts.linear_fc1.weight"),
    RowParallel(hf="model.layers.*.mlp.shared_expert.down_proj.weight",
                megatron="decoder.layers.*.mlp.shared_experts.linear_fc2.weight"),
    Replicated(hf="model.layers.*.mlp.shared_expert_gate.weight",
               megatron="decoder.layers.*.mlp.shared_experts.gate_weight"),
)


@register("Qwen2MoeForCausalLM")
class Qwen2MoeBridge(MoEBridge):
    """Qwen2-MoE (e.g. Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B): bias on q/k/v, top-k softmax router
    (`norm_topk_prob` either way), a gated shared expert in every MoE layer; sliding-window attention is
    refused."""

    qkv_bias = True
    mapping_table = QWEN2_TABLE + ROUTED_EXPERTS_TABLE + SHARED_EXPERT_TABLE

    def unsupported_options(self) -> list[str]:
        problems = super().unsupported_options() + window_refusals(self.hf)
        if not getattr(self.hf, "qkv_bias", True):
            problems.append("qkv_bias=False (the table maps Qwen2's q/k/v biases)")
        if not getattr(self.hf, "shared_expert_intermediate_size", 0):
            problems.append("shared_expert_intermediate_size=0 (no shared expert; the table maps one)")
        return problems

    def tp_divided_sizes(self) -> list[tuple[str, int]]:
        return super().tp_divided_sizes() + [("shared_expert_intermediate_size",
                                              self.hf.shared_expert_intermediate_size)]

    def shared_expert_settings(self) -> dict[str, Any]:
        return dict(moe_shared_expert_intermediate_size=self.hf.shared_expert_intermediate_size,
                    moe_shared_expert_gate=True, moe_shared_expert_overlap=False)
