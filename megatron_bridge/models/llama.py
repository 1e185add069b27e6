"""Llama 3 (LlamaForCausalLM) <-> megatron GPTModel: the mapping table and Llama's refusals."""
from __future__ import annotations

from megatron_bridge.mapping import QKV, GatedMLP, Replicated, RowParallel, VocabParallel
from megatron_bridge.models.base import DecoderBridge, register

LLAMA_TABLE = (
    VocabParallel(hf="model.embed_tokens.weight", megatron="embedding.word_embeddings.weight"),
    Replicated(hf="model.layers.*.input_layernorm.weight", megatron="decoder.layers.*.input_layernorm.weight"),
    QKV(q="model.layers.*.self_attn.q_proj.weight", k="model.layers.*.self_attn.k_proj.weight",
        v="model.layers.*.self_attn.v_proj.weight", megatron="decoder.layers.*.self_attention.linear_qkv.weight"),
    RowParallel(hf="model.layers.*.self_attn.o_proj.weight",
                megatron="decoder.layers.*.self_attention.linear_proj.weight"),
    Replicated(hf="model.layers.*.post_attention_layernorm.weight",
               megatron="decoder.layers.*.pre_mlp_layernorm.weight"),
    GatedMLP(gate="model.layers.*.mlp.gate_proj.weight", up="model.layers.*.mlp.up_proj.weight",
             megatron="decoder.layers.*.mlp.linear_fc1.weight"),
    RowParallel(hf="model.layers.*.mlp.down_proj.weight", megatron="decoder.layers.*.mlp.linear_fc2.weight"),
    Replicated(hf="model.norm.weight", megatron="decoder.final_layernorm.weight"),
    VocabParallel(hf="lm_head.weight", megatron="output_layer.weight"),
)


@register("LlamaForCausalLM")
class LlamaBridge(DecoderBridge):
    """Llama 2/3 family: no biases; Llama 3.x rope scaling ("llama3") supported."""

    qkv_bias = False
    mapping_table = LLAMA_TABLE

    def unsupported_options(self) -> list[str]:
        return super().unsupported_options() + self.llama_refusals(self.hf)

    @staticmethod
    def llama_refusals(hf) -> list[str]:
        """What a Llama config may set that the table does not map."""
        return [f"{option}=True (biases on every projection are not mapped)"
                for option in ("attention_bias", "mlp_bias") if getattr(hf, option, False)]
