"""What the mixture-of-experts bridges (qwen3_moe.py, qwen2_moe.py) share: the router and routed experts'
mappings, the dense/MoE layer pattern, megatron's MoE settings and the MoE refusals.

A MoE layer's MLP is megatron's `MoELayer` with the local `SequentialMLP` experts (`moe_grouped_gemm=False`:
grouped GEMM needs Transformer Engine or a GPU), one SwiGLU MLP per expert, `mlp.experts.local_experts.<j>`
with j the expert's index on its expert-parallel rank. The router (`mlp.router.weight`, [experts, hidden])
is replicated. Routing matches Hugging Face's: softmax over all experts, the top k, their weights
renormalised when `norm_topk_prob` (megatron: top k of the logits, then softmax over those k, which is the
same) or not (megatron's `moe_router_pre_softmax`). No token is dropped (no capacity factor). Tokens reach
their experts through the all-to-all dispatcher, which takes variable sequence lengths.
"""
from __future__ import annotations

from typing import Any

from megatron_bridge.mapping import GatedMLP, ParamMapping, Replicated, RowParallel
from megatron_bridge.models.base import DecoderBridge

DENSE_MLP_PREFIX = "decoder.layers.*.mlp.linear_fc"  # a dense layer's fc1 / fc2 in megatron's names

ROUTED_EXPERTS_TABLE = (
    Replicated(hf="model.layers.*.mlp.gate.weight", megatron="decoder.layers.*.mlp.router.weight"),
    GatedMLP(gate="model.layers.*.mlp.experts.#.gate_proj.weight", up="model.layers.*.mlp.experts.#.up_proj.weight",
             megatron="decoder.layers.*.mlp.experts.local_experts.#.linear_fc1.weight"),
    RowParallel(hf="model.layers.*.mlp.experts.#.down_proj.weight",
                megatron="decoder.layers.*.mlp.experts.local_experts.#.linear_fc2.weight"),
)


class MoEBridge(DecoderBridge):
    """A decoder whose MLP is, in the layers `is_moe_layer` names, a routed mixture of SwiGLU experts.

    Subclasses give `mapping_table` with both the dense MLP's entries (used in dense layers) and the
    experts' (`ROUTED_EXPERTS_TABLE`, plus any shared expert's), and may add `shared_expert_settings`.
    """

    @property
    def num_experts(self) -> int:
        return int(getattr(self.hf, "num_experts", None) or getattr(self.hf, "num_local_experts", 0) or 0)

    @property
    def experts_per_token(self) -> int:
        return int(self.hf.num_experts_per_tok)

    def is_moe_layer(self, layer: int) -> bool:
        """Hugging Face's rule (Qwen2-MoE, Qwen3-MoE): not in `mlp_only_layers`, and every
        `decoder_sparse_step`-th layer."""
        step = int(getattr(self.hf, "decoder_sparse_step", 1) or 1)
        return layer not in (getattr(self.hf, "mlp_only_layers", None) or []) and (layer + 1) % step == 0

    @property
    def has_dense_layers(self) -> bool:
        return not all(self.is_moe_layer(i) for i in range(self.hf.num_hidden_layers))

    def unsupported_options(self) -> list[str]:
        problems = super().unsupported_options()
        if self.num_experts < 1:
            problems.append(f"num_experts={self.num_experts} (a mixture of experts needs at least one)")
        elif not 1 <= self.experts_per_token <= self.num_experts:
            problems.append(f"num_experts_per_tok={self.experts_per_token} with {self.num_experts} experts")
        return problems

    def tp_divided_sizes(self) -> list[tuple[str, int]]:
        sizes = super().tp_divided_sizes()
        if not self.has_dense_layers:
            sizes = [(what, n) for what, n in sizes if what != "intermediate_size"]
        return sizes + [("moe_intermediate_size", self.hf.moe_intermediate_size)]

    def shared_expert_settings(self) -> dict[str, Any]:
        """megatron's shared-expert fields (none here)."""
        return {}

    def moe_settings(self, *, ep: int, aux_loss_coeff: float, z_loss_coeff: float) -> dict[str, Any]:
        return dict(
            num_moe_experts=self.num_experts, moe_router_topk=self.experts_per_token,
            moe_ffn_hidden_size=self.hf.moe_intermediate_size,
            moe_layer_freq=[int(self.is_moe_layer(i)) for i in range(self.hf.num_hidden_layers)],
            moe_router_pre_softmax=not getattr(self.hf, "norm_topk_prob", False),
            moe_router_score_function="softmax", moe_grouped_gemm=False, expert_model_parallel_size=ep,
            moe_router_load_balancing_type="aux_loss" if aux_loss_coeff > 0 else "none",
            moe_aux_loss_coeff=float(aux_loss_coeff), moe_z_loss_coeff=float(z_loss_coeff) or None,
            **self.shared_expert_settings())

    def layer_mappings(self, layer: int) -> list[ParamMapping]:
        per_layer = super().layer_mappings(layer)
        if self.is_moe_layer(layer):
            return [m for m in per_layer if not m.megatron.startswith(DENSE_MLP_PREFIX)]
        return [m for m in per_layer if not m.megatron.startswith(("decoder.layers.*.mlp.router",
                                                                    "decoder.layers.*.mlp.experts",
                                                                    "decoder.layers.*.mlp.shared_experts"))]
