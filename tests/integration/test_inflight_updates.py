"""In-flight weight updates on a real vLLM engine (tests/integration/inflight_probe.py in a subprocess, one engine
start): requests stepped with one version, the next loaded between two engine steps without draining
(`VLLMEngine.load_weights_in_flight`), the requests finished. Each sample's tokens really come from two versions (vLLM's
weight-version spans), and each token's log-probability is its version's, checked against Hugging Face transformers
teacher-forced on each version's weights: with `recompute` the new-version tokens are exactly the new version's; with
`keep` they are the new weights over the KV cache the old weights computed, which transformers reproduces by
continuing the old model's cache with the new model (and which differs from the new version's own log-probs)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from benchmarks.inflight import old_cache_continuation, teacher_forced

pytestmark = [pytest.mark.integration, pytest.mark.vllm]

REPO = Path(__file__).resolve().parents[2]
TOLERANCE = 2e-4  # vLLM's float32 CPU kernels against transformers' (tests/integration/test_engine.py)


@pytest.fixture(scope="module")
def probe(tiny_model, tmp_path_factory):
    work = tmp_path_factory.mktemp("inflight")
    env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    proc = subprocess.run([sys.executable, str(REPO / "tests/integration/inflight_probe.py"), str(tiny_model),
                           str(work), "0.3", "24", "6", "4"], capture_output=True, text=True, timeout=420,
                          env=env)
    marker = [line for line in proc.stdout.splitlines() if line.startswith("PROBE-RESULT ")]
    assert proc.returncode == 0 and marker, f"in-flight probe failed ({proc.returncode}):\n{proc.stderr[-4000:]}"
    return {s["version"]: s for s in json.loads(marker[0].removeprefix("PROBE-RESULT "))["scenarios"]}


@pytest.fixture(scope="module")
def models(tiny_model, probe):
    from transformers import AutoModelForCausalLM

    paths = {0: tiny_model, 1: probe[1]["path"], 2: probe[2]["path"]}
    return {v: AutoModelForCausalLM.from_pretrained(p, dtype=torch.float32).eval() for v, p in paths.items()}


def split_completions(probe: dict, new: int) -> list[tuple[dict, int]]:
    """(completion, s) for the completions of the scenario that loaded version `new` in flight whose tokens 0..s-1
    are version new - 1 and s.. version `new` (at least 4 of them); every completion's versions are checked to be
    such a split (or all new - 1: it ended before the reload)."""
    scenario, old = probe[new], new - 1
    assert scenario["in_flight_at_reload"] > 0 and scenario["weights_version"] == new
    split = []
    for c in scenario["completions"]:
        versions = c["versions"]
        s = versions.index(new) if new in versions else len(versions)
        assert versions == [old] * s + [new] * (len(versions) - s), versions
        assert c["version"] == min(versions)  # a completion's version is its oldest token's
        if 0 < s < len(versions):
            split.append((c, s))
    assert len(split) >= 4, "samples whose tokens come from two versions"
    return split


def test_recompute_each_token_has_its_versions_log_prob(probe, models):
    drift = []
    for c, s in split_completions(probe, new=2):
        lp = np.array(c["logprobs"])
        np.testing.assert_allclose(lp[:s], teacher_forced(models[1], c["prompt"], c["tokens"])[:s], atol=TOLERANCE)
        np.testing.assert_allclose(lp[s:], teacher_forced(models[2], c["prompt"], c["tokens"])[s:], atol=TOLERANCE)
        drift += list(np.abs(lp[s:] - teacher_forced(models[1], c["prompt"], c["tokens"])[s:]))
    assert np.mean(drift) > 100 * TOLERANCE, "the two versions must be told apart"


def test_keep_new_tokens_are_the_new_weights_over_the_old_kv_cache(probe, models):
    gap = []
    for c, s in split_completions(probe, new=1):
        lp, prompt, tokens = np.array(c["logprobs"]), c["prompt"], c["tokens"]
        np.testing.assert_allclose(lp[:s], teacher_forced(models[0], prompt, tokens)[:s], atol=TOLERANCE)
        # the KV of prompt + tokens[:s-1] was computed by version 0; token s-1's own KV and everything after by 1
        np.testing.assert_allclose(lp[s:], old_cache_continuation(models[0], models[1], prompt, tokens, s),
                                   atol=TOLERANCE)
        gap += list(np.abs(lp[s:] - teacher_forced(models[1], prompt, tokens)[s:]))
    assert np.mean(gap) > 100 * TOLERANCE, "keeping the old KV cache must differ from the new version's log-probs"
