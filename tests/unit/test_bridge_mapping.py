"""megatron_bridge in one process: TP shard/merge arithmetic of the mapping classes, vocabulary padding,
and the HF config -> megatron translation with its refusals. (Multi-process checks: tests/distributed.)"""
from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, Qwen2Config, Qwen2MoeConfig, Qwen3Config, Qwen3MoeConfig

from megatron_bridge.mapping import QKV, ColumnParallel, GatedMLP, ModelDims, Replicated, RowParallel, VocabParallel
from megatron_bridge.models import UnsupportedModelError, bridge_for, padded_vocab_size

DIMS = ModelDims(hidden_size=16, ffn_hidden_size=24, num_layers=2, num_heads=8, num_kv_heads=4, head_dim=2,
                 vocab_size=13, padded_vocab_size=16)


class MemorySource:
    """A TensorSource over a dict, recording which rows/columns were read."""

    def __init__(self, tensors: dict[str, torch.Tensor]):
        self.tensors, self.reads = tensors, []

    def shape(self, name):
        return tuple(self.tensors[name].shape)

    def dtype(self, name):
        return self.tensors[name].dtype

    def read(self, name, dim=None, start=0, stop=None):
        self.reads.append((name, dim, start, stop))
        t = self.tensors[name]
        return t.clone() if dim is None else t.narrow(dim, start, (stop or t.shape[dim]) - start).clone()


def hf_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    q_rows, kv_rows = DIMS.num_heads * DIMS.head_dim, DIMS.num_kv_heads * DIMS.head_dim
    shapes = {"q": (q_rows, 16), "k": (kv_rows, 16), "v": (kv_rows, 16), "qb": (q_rows,), "kb": (kv_rows,),
              "vb": (kv_rows,), "gate": (24, 16), "up": (24, 16), "down": (16, 24), "o": (16, q_rows),
              "norm": (16,), "embed": (13, 16)}
    return {name: torch.randn(shape, generator=g) for name, shape in shapes.items()}


MAPPINGS = [
    QKV(q="q", k="k", v="v", megatron="qkv"), QKV(q="qb", k="kb", v="vb", megatron="qkv_bias"),
    GatedMLP(gate="gate", up="up", megatron="fc1"), RowParallel(hf="down", megatron="fc2"),
    RowParallel(hf="o", megatron="proj"), ColumnParallel(hf="gate", megatron="col"),
    Replicated(hf="norm", megatron="norm"), VocabParallel(hf="embed", megatron="embedding"),
]


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("mapping", MAPPINGS, ids=lambda m: type(m).__name__ + ":" + m.megatron)
def test_shards_merge_back_to_the_hf_tensors_exactly(mapping, tp):
    source = MemorySource(hf_tensors())
    shards = [mapping.load_shard(source, rank, tp, DIMS) for rank in range(tp)]
    assert len({s.shape for s in shards}) == 1, "every TP rank gets an equal shard"
    merged = mapping.merge_shards(shards, DIMS)
    assert sorted(merged) == sorted(mapping.hf_names)
    for name, tensor in merged.items():
        assert torch.equal(tensor, source.tensors[name]), name


def test_fused_qkv_interleaves_query_groups_as_megatron_expects():
    t = hf_tensors()
    fused = QKV(q="q", k="k", v="v", megatron="qkv").load_shard(MemorySource(t), 0, 1, DIMS)
    hd, hpg = DIMS.head_dim, DIMS.heads_per_group  # group g: hpg query heads, then its key, then its value
    group = (hpg + 2) * hd
    for g in range(DIMS.num_kv_heads):
        block = fused[g * group:(g + 1) * group]
        assert torch.equal(block[:hpg * hd], t["q"][g * hpg * hd:(g + 1) * hpg * hd])
        assert torch.equal(block[hpg * hd:(hpg + 1) * hd], t["k"][g * hd:(g + 1) * hd])
        assert torch.equal(block[(hpg + 1) * hd:], t["v"][g * hd:(g + 1) * hd])


def test_gated_mlp_shard_is_gate_slice_then_up_slice():
    t = hf_tensors()
    shard = GatedMLP(gate="gate", up="up", megatron="fc1").load_shard(MemorySource(t), 1, 2, DIMS)
    assert torch.equal(shard, torch.cat([t["gate"][12:], t["up"][12:]]))


def test_a_tp_rank_reads_only_its_own_rows():
    source = MemorySource(hf_tensors())
    QKV(q="q", k="k", v="v", megatron="qkv").load_shard(source, 1, 2, DIMS)
    assert source.reads == [("q", 0, 8, 16), ("k", 0, 4, 8), ("v", 0, 4, 8)]


def test_vocab_padding_rows_are_zero_and_dropped_on_merge():
    source = MemorySource(hf_tensors())
    mapping = VocabParallel(hf="embed", megatron="embedding")
    last = mapping.load_shard(source, 1, 2, DIMS)  # rows 8..15 of the padded 16; 13..15 are padding
    assert torch.equal(last[:5], source.tensors["embed"][8:]) and not last[5:].any()


@pytest.mark.parametrize("vocab,tp,padded", [(101, 1, 101), (101, 2, 102), (99, 2, 100), (151936, 1, 151936),
                                             (151936, 2, 152064), (128256, 2, 128256), (128256, 8, 129024)])
def test_padded_vocab_size(vocab, tp, padded):
    assert padded_vocab_size(vocab, tp) == padded


def qwen2(**overrides) -> Qwen2Config:
    base = dict(vocab_size=101, hidden_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                intermediate_size=256, rms_norm_eps=1e-6, tie_word_embeddings=True, architectures=["Qwen2ForCausalLM"])
    return Qwen2Config(**{**base, **overrides})


def llama(**overrides) -> LlamaConfig:
    base = dict(vocab_size=99, hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                intermediate_size=256, rms_norm_eps=1e-5, tie_word_embeddings=False, architectures=["LlamaForCausalLM"])
    return LlamaConfig(**{**base, **overrides})


def qwen3_moe(**overrides) -> Qwen3MoeConfig:
    base = dict(vocab_size=99, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                head_dim=24, intermediate_size=128, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
                norm_topk_prob=True, mlp_only_layers=[1], architectures=["Qwen3MoeForCausalLM"])
    return Qwen3MoeConfig(**{**base, **overrides})


def qwen2_moe(**overrides) -> Qwen2MoeConfig:
    base = dict(vocab_size=99, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                intermediate_size=128, moe_intermediate_size=32, shared_expert_intermediate_size=64, num_experts=4,
                num_experts_per_tok=2, norm_topk_prob=False, architectures=["Qwen2MoeForCausalLM"])
    return Qwen2MoeConfig(**{**base, **overrides})


def test_qwen3_moe_config_translates_to_megatron():
    bridge = bridge_for(qwen3_moe())
    config = bridge.transformer_config(tp=1, pp=2, ep=4, dtype="float32", on_cpu=True, aux_loss_coeff=0.01)
    assert config.qk_layernorm and config.kv_channels == 24 and not config.add_qkv_bias
    assert (config.num_moe_experts, config.moe_router_topk, config.moe_ffn_hidden_size) == (8, 2, 32)
    assert config.moe_layer_freq == [1, 0, 1, 1]  # mlp_only_layers=[1]: layer 1 keeps a dense MLP
    assert not config.moe_router_pre_softmax  # norm_topk_prob: softmax over the chosen k
    assert config.expert_model_parallel_size == 4 and not config.moe_grouped_gemm
    assert config.moe_router_load_balancing_type == "aux_loss" and config.moe_z_loss_coeff is None
    names = {m.megatron for m in bridge.layer_mappings(1)}
    assert "decoder.layers.*.mlp.linear_fc1.weight" in names and not any(".experts." in n for n in names)
    names = {m.megatron for m in bridge.layer_mappings(0)}
    assert "decoder.layers.*.mlp.router.weight" in names and "decoder.layers.*.mlp.linear_fc1.weight" not in names


def test_qwen2_moe_shared_expert_and_sequence_parallelism_at_tp2():
    config = bridge_for(qwen2_moe()).transformer_config(tp=2, pp=1, dtype="float32", on_cpu=True)
    assert config.moe_shared_expert_intermediate_size == 64 and config.moe_shared_expert_gate
    assert config.moe_router_pre_softmax and config.add_qkv_bias  # norm_topk_prob=False: softmax over all
    assert config.sequence_parallel  # megatron trains MoE at TP > 1 only with it
    assert not bridge_for(qwen2()).transformer_config(tp=2, pp=1, dtype="float32", on_cpu=True).sequence_parallel


def test_qwen2_config_translates_to_megatron():
    bridge = bridge_for(qwen2(rope_theta=1e6))
    config = bridge.transformer_config(tp=2, pp=2, dtype="float32", on_cpu=True)
    assert (config.num_layers, config.hidden_size, config.ffn_hidden_size) == (4, 128, 256)
    assert (config.num_attention_heads, config.num_query_groups, config.kv_channels) == (4, 2, 32)
    assert config.add_qkv_bias and not config.add_bias_linear and config.gated_linear_unit
    assert config.normalization == "RMSNorm" and config.layernorm_epsilon == 1e-6
    assert (config.tensor_model_parallel_size, config.pipeline_model_parallel_size) == (2, 2)
    kwargs = bridge.gpt_model_kwargs(tp=2)
    assert kwargs["rotary_base"] == 1e6 and kwargs["share_embeddings_and_output_weights"]
    assert kwargs["vocab_size"] == 102 and not kwargs["rope_scaling"]
    assert all(m.megatron != "output_layer.weight" for m in bridge.mappings()), "tied: no separate lm_head"


def test_llama3_rope_scaling_and_untied_head():
    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    bridge = bridge_for(llama(rope_scaling=rope, rope_theta=500000.0))
    kwargs = bridge.gpt_model_kwargs(tp=1)
    assert kwargs["rope_scaling"] and kwargs["rope_scaling_factor"] == 32.0 and kwargs["rotary_base"] == 500000.0
    assert not bridge.transformer_config(tp=1, pp=1, dtype="bfloat16", on_cpu=True).add_qkv_bias
    assert any(m.megatron == "output_layer.weight" for m in bridge.mappings())


@pytest.mark.parametrize("config,named", [
    (lambda: qwen2(architectures=["GPT2LMHeadModel"]), "GPT2LMHeadModel"),
    (lambda: qwen2(use_sliding_window=True, sliding_window=64), "use_sliding_window"),
    (lambda: qwen2(hidden_act="gelu"), "hidden_act"),
    (lambda: Qwen3Config(architectures=["Qwen3ForCausalLM"], use_sliding_window=True, sliding_window=64),
     "use_sliding_window"),
    (lambda: Qwen3Config(architectures=["Qwen3ForCausalLM"], attention_bias=True), "attention_bias"),
    (lambda: qwen3_moe(num_experts_per_tok=9), "num_experts_per_tok=9"),
    (lambda: qwen3_moe(use_sliding_window=True, sliding_window=64), "use_sliding_window"),
    (lambda: qwen2_moe(shared_expert_intermediate_size=0), "shared_expert_intermediate_size=0"),
    (lambda: qwen2_moe(qkv_bias=False), "qkv_bias=False"),
    (lambda: llama(attention_bias=True), "attention_bias"),
    (lambda: llama(rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096}),
     "yarn"),
    (lambda: llama(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 2.0,
                                 "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
     "low_freq_factor"),
])
def test_unsupported_models_are_refused_by_name(config, named):
    with pytest.raises(UnsupportedModelError, match=named):
        bridge_for(config())


@pytest.mark.parametrize("ep,named", [(3, "expert parallel size 3 does not divide the model's 8 experts")])
def test_expert_parallel_sizes_that_do_not_divide_the_experts_are_refused(ep, named):
    with pytest.raises(ValueError, match=named):
        bridge_for(qwen3_moe()).transformer_config(tp=1, pp=1, ep=ep, dtype="float32", on_cpu=True)


@pytest.mark.parametrize("tp,pp,named", [(3, 1, "3 does not divide"), (1, 3, "pipeline parallel size 3")])
def test_parallel_sizes_that_do_not_divide_the_model_are_refused(tp, pp, named):
    with pytest.raises(ValueError, match=named):
        bridge_for(qwen2()).transformer_config(tp=tp, pp=pp, dtype="float32", on_cpu=True)
