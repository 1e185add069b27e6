"""The largest-record estimate of `rft validate` (rft.run.record_size) against a hand computation and against real
encoded groups of that size: dense, a Qwen3-MoE config.json (dense layers, sparse step, uint16 ids), routing from the
last prompt position or the prefill, in-flight version spans; and what it says about the claim-check and the limit."""
from __future__ import annotations

import json

import numpy as np
import pytest

from rft.models.moe import MoEShape, read_moe_shape
from rft.run.config import config_from_dict
from rft.run.record_size import VERSION_SPAN_BYTES, claim_bytes, describe, estimate_record, whole_body_claim_bytes
from rft.schema import ExperienceGroup, RoutedExperts, Sample, encode


def config(**sections):
    raw = {"model": {"path": "unused", "max_prompt_len": 10, "max_response_len": 20},
           "explorer": {"n_samples": 4, "max_tokens": 20}}
    for name, values in sections.items():
        raw[name] = {**raw.get(name, {}), **values}
    return config_from_dict(raw)


def largest_group(cfg, moe: MoEShape | None = None, spans: int = 0) -> bytes:
    """A real group of the config's largest samples (ids as long as the estimate assumes)."""
    prompt, response = cfg.model.max_prompt_len, cfg.explorer.max_tokens
    samples = []
    for j in range(cfg.explorer.n_samples):
        routed = None
        if moe is not None:
            first = RoutedExperts.start(prompt, cfg.run.routing_prefill)
            dtype = RoutedExperts.dtype_for(moe.num_experts)
            ids = np.full((prompt + response - 1 - first, len(moe.layers), moe.top_k), moe.num_experts - 1, dtype)
            routed = RoutedExperts(ids=ids, num_experts=moe.num_experts, layers=list(moe.layers), first_position=first)
        versions = None
        if spans:  # `spans` runs of equal versions
            versions = np.repeat(np.arange(spans, dtype=np.int64), -(-response // spans))[:response]
        samples.append(Sample(sample_index=j, prompt_tokens=np.arange(prompt, dtype=np.int32),
                              response_tokens=np.arange(response, dtype=np.int32),
                              logprobs=np.full(response, -0.25, np.float32), loss_mask=np.ones(response, np.uint8),
                              reward=1.0, finish_reason="length", routed_experts=routed, token_versions=versions))
    task = "gsm8k-train-000123"
    return encode(ExperienceGroup(run_id=cfg.run.name, task_id=task, group_id=f"{cfg.run.name}/{task}/e0",
                                  attempt=0, explorer_id="explorer-0", policy_version=0, samples=samples))[0]


def test_a_dense_group_by_hand():
    cfg = config()
    e = estimate_record(cfg)
    # per sample: int32 prompt (10 x 4), int32 response, float32 log-probs (20 x 4 each), uint8 mask (20), each a
    # msgpack bin with a 2-byte header (under 256 bytes)
    assert e.parts == {"prompt_tokens": 42, "response_tokens": 82, "logprobs": 82, "loss_mask": 22}
    assert (e.samples, e.prompt_tokens, e.response_tokens, e.routing_bytes) == (4, 10, 20, 0)
    real = len(largest_group(cfg))
    assert e.inline_bytes - 4 * 228 == e.framing and 0 <= e.inline_bytes - real <= 64  # ids' lengths: a few bytes


def test_the_response_is_max_tokens_single_turn_and_max_response_len_otherwise():
    assert estimate_record(config(explorer={"max_tokens": 5})).response_tokens == 5
    assert estimate_record(config(explorer={"max_tokens": 5, "workflow": "multi_turn"})).response_tokens == 20


def test_an_agent_program_group_holds_a_sample_per_branch_at_most_one_per_call():
    assert estimate_record(config(explorer={"workflow": "agent_program", "agent_max_calls": 3})).samples == 3 * config(
        explorer={}).explorer.n_samples


@pytest.fixture
def qwen3_moe(tmp_path):
    """A Qwen3-MoE config.json: 6 decoder layers, every 2nd sparse (1, 3, 5), layer 1 dense by mlp_only_layers;
    300 experts (uint16 ids), top-4."""
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["Qwen3MoeForCausalLM"], "num_hidden_layers": 6, "num_experts": 300,
        "num_experts_per_tok": 4, "decoder_sparse_step": 2, "mlp_only_layers": [1]}))
    return tmp_path


def test_a_moe_group_by_hand(qwen3_moe):
    moe = read_moe_shape(qwen3_moe)
    assert moe == MoEShape(layers=(3, 5), num_experts=300, top_k=4, num_hidden_layers=6)
    cfg = config(model={"path": str(qwen3_moe)}, run={"routing_replay": True})
    e = estimate_record(cfg)
    # from the last prompt position: 20 positions (one per response token) x 2 layers x top-4 x 2 bytes = 320, +3
    assert e.parts["routed_experts"] == 323 and e.routing_bytes == 4 * 323 and e.moe == moe
    real = len(largest_group(cfg, moe))
    assert 0 <= e.inline_bytes - real <= 64
    prefill = config(model={"path": str(qwen3_moe)}, run={"routing_replay": True, "routing_prefill": True})
    p = estimate_record(prefill)
    # the prefill too: 10 + 20 - 1 = 29 positions x 16 bytes = 464 (a bin16 header: 3 bytes)
    assert p.parts["routed_experts"] == 467
    assert 0 <= p.inline_bytes - len(largest_group(prefill, moe)) <= 64


def test_a_qwen3_30b_a3b_long_trace_by_hand():
    """48 MoE layers, 128 experts (uint8), top-8: 384 bytes a position; 16 samples x (256 + 16,384) tokens."""
    moe = MoEShape(layers=tuple(range(48)), num_experts=128, top_k=8, num_hidden_layers=48)
    cfg = config(model={"max_prompt_len": 256, "max_response_len": 16384},
                 explorer={"n_samples": 16, "max_tokens": 16384}, run={"routing_replay": True})
    e = estimate_record(cfg, moe)
    assert e.parts["routed_experts"] == 16384 * 384 + 5
    assert e.routing_bytes == 16 * (16384 * 384 + 5)
    assert e.inline_bytes == e.framing + 16 * (1024 + 3 + 2 * (65536 + 5) + 16384 + 3 + 16384 * 384 + 5)
    # claim-checked at 131072: only the routing map leaves each sample; the rest (2.4 MB) is still over 1 MB
    assert e.claimed_parts(131072) == ["routed_experts"]
    assert e.claimed_bytes(131072) == e.inline_bytes - e.routing_bytes + 16 * claim_bytes()
    lines, warnings = describe(cfg.with_values({"kafka.max_record_bytes": 1000000}), e)
    assert not warnings
    assert lines[0] == ("largest experience record: 16 samples x 16,640 tokens (256 prompt + 16,384 response): "
                        "103.0 MB inline (routing 100.7 MB: 48 MoE layers x top-8 x 1 byte a position, from the last "
                        "prompt position)")
    assert "go to the claim store (records.store: beside the weights" in lines[1] and "routed_experts" in lines[1]
    assert lines[2].startswith("still over kafka.max_record_bytes (1,000,000) at 2.4 MB: the body, its parts "
                               "claimed, goes to")
    assert lines[2].endswith(f"record ~{whole_body_claim_bytes(cfg)} B")


def test_in_flight_updates_add_version_spans():
    plain = estimate_record(config())
    cfg = config(explorer={"inflight_updates": True, "continuous": True}, run={"max_staleness": 2})
    e = estimate_record(cfg)
    assert e.framing - plain.framing == 4 * 3 * VERSION_SPAN_BYTES  # staleness 2: three versions a sample sees
    assert len(largest_group(cfg, spans=3)) <= e.inline_bytes


def test_what_validate_says_about_the_limit():
    big = config(model={"max_response_len": 4096}, explorer={"n_samples": 64, "max_tokens": 4096})
    e = estimate_record(big)  # 64 x 4096 x 9 bytes: 2.4 MB, no part over 131072 (16 KB each)
    never = big.with_values({"records.claim_threshold_bytes": 0, "kafka.max_record_bytes": 1000000})
    lines, warnings = describe(never, e)
    assert warnings == ["the largest record (2.4 MB) is over kafka.max_record_bytes (1,000,000) and "
                        "records.claim_threshold_bytes is 0: every group will be dead-lettered as too large: set "
                        "records.claim_threshold_bytes"]
    lines, warnings = describe(big.with_values({"kafka.max_record_bytes": 1000000}), e)
    assert not warnings and lines[1].startswith(
        "over kafka.max_record_bytes (1,000,000) at 2.4 MB: the body, its parts claimed")
    lines, warnings = describe(big.with_values({"records.claim_threshold_bytes": 8192}), e)
    assert "go to the claim store" in lines[1] and lines[1].endswith("): response_tokens, logprobs: record ~287.7 KB")
    lines, warnings = describe(config(), estimate_record(config()))
    assert not warnings and lines[1].startswith("inline, under kafka.max_record_bytes")
