"""`explorer.min_tokens`: no stop token ends a sample before that many new tokens (the transformers engine passes it
as `min_new_tokens`; vLLM as `min_tokens`), so a run can size its records at full length (long-trace runs,
tests/e2e/test_long_routing_records.py); the config refuses more than explorer.max_tokens."""
from __future__ import annotations

import pytest

from rft.config import ConfigError
from rft.engine import SamplingSettings, TransformersEngine
from rft.run.config import config_from_dict


def test_a_random_model_stops_early_unless_min_tokens_holds_it_to_full_length(tiny_model):
    engine = TransformersEngine(tiny_model, seed=0)
    prompt = engine.encode(":7")
    free = engine.generate([prompt], SamplingSettings(n=8, max_tokens=300))[0].completions
    assert any(c.finish_reason == "stop" and len(c.token_ids) < 300 for c in free)  # EOS is ~1 token in 99
    held = engine.generate([prompt], SamplingSettings(n=8, max_tokens=300, min_tokens=300))[0].completions
    assert [(len(c.token_ids), c.finish_reason) for c in held] == [(300, "length")] * 8
    assert all(engine.tokenizer.eos_token_id not in c.token_ids for c in held)


def test_min_tokens_is_at_most_max_tokens_and_the_sampling_settings_carry_it():
    cfg = config_from_dict({"model": {"path": "m", "max_response_len": 16}, "explorer": {"max_tokens": 32,
                                                                                          "min_tokens": 32}})
    assert SamplingSettings.from_config(cfg.explorer, cfg.model).min_tokens == 16  # the response's bound
    with pytest.raises(ConfigError, match=r"explorer.min_tokens: must be at most explorer.max_tokens \(8\), got 9"):
        config_from_dict({"model": {"path": "m"}, "explorer": {"max_tokens": 8, "min_tokens": 9}})


def test_a_long_generation_decodes_into_a_static_cache_with_the_full_forwards_log_probs(tmp_path, monkeypatch):
    """From STATIC_CACHE_FROM new tokens on the engine decodes into a static KV cache: each token's behaviour log-prob
    is still the full sequence forward's, and the routing covers every input position."""
    import numpy as np
    import torch

    import rft.engine.hf_engine as hf_engine
    from rft.models.tiny import make_tiny_model

    calls = []
    moe = make_tiny_model(tmp_path / "moe", arch="qwen3_moe", experts=8, experts_per_token=2)
    engine = TransformersEngine(moe, seed=1, record_routing=True)
    generate = engine.model.generate
    monkeypatch.setattr(engine.model, "generate", lambda *a, **k: calls.append(k.get("cache_implementation"))
                        or generate(*a, **k))
    monkeypatch.setattr(hf_engine, "STATIC_CACHE_FROM", 200)
    prompt = engine.encode(":7")
    completions = engine.generate([prompt], SamplingSettings(n=2, max_tokens=200, min_tokens=200))[0].completions
    assert calls == ["static"]
    for c in completions:
        assert len(c.token_ids) == 200 and c.routed_experts.ids.shape == (200, 2, 2)  # from the last prompt position
        assert c.routed_experts.first_position == len(prompt) - 1
        with torch.no_grad():
            logits = engine.model(torch.tensor([prompt + c.token_ids[:-1]])).logits[0, len(prompt) - 1:]
        logits[:, engine.tokenizer.eos_token_id] = -float("inf")  # min_tokens: the sampler never saw EOS
        expected = torch.log_softmax(logits.float(), -1)[torch.arange(200), torch.tensor(c.token_ids)].numpy()
        np.testing.assert_allclose(c.logprobs, expected, atol=1e-4)

