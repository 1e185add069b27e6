"""Per-stage weight publishing on the pull path at PP=2 (torchrun, gloo): each pipeline stage's publishing rank
writes its own shards into the version's staging directory and rank 0 completes the version (rft.weights).

One 2-process launch (_worker_stage_publish.py) publishes versions 0 and 1 through the trainer's own code for a
tied-embedding Qwen2 (with and without write-behind) and an untied Llama (lm_head on the last stage). Checked
here: every HF tensor of the checkpoint is in each version exactly once and bit-exact (version 1 = checkpoint
+ 1.0), each stage wrote its own shards, the index lists every shard, the announcements came in order with LATEST,
no staging leftovers, and transformers loads the version directory as an HF model.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rft.models.tiny import make_tiny_model
from rft.weights.store import INDEX, MANIFEST, WeightStore, verify_version

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _launch import HERE, assert_succeeded, torchrun  # noqa: E402

pytestmark = pytest.mark.distributed

CASES = [("qwen_behind", "qwen", True), ("qwen_inline", "qwen", False), ("llama_behind", "llama", True)]


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("stage-models")
    return {"qwen": make_tiny_model(root / "qwen", arch="qwen2", layers=4, vocab_size=101, seed=1),
            "llama": make_tiny_model(root / "llama", arch="llama", tie_word_embeddings=False, seed=2)}


@pytest.fixture(scope="module")
def results(models, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("stage-results")
    spec = {"out_dir": str(out), "cases": [{"name": name, "hf_dir": str(models[model]), "write_behind": behind}
                                           for name, model, behind in CASES]}
    (out / "spec.json").write_text(json.dumps(spec))
    assert_succeeded(torchrun([str(HERE / "_worker_stage_publish.py"), str(out / "spec.json")]))
    return out


@pytest.mark.parametrize("case,model", [(c[0], c[1]) for c in CASES])
def test_every_tensor_once_bit_exact_from_both_stages(results, models, case, model):
    original = load_file(models[model] / "model.safetensors")
    if json.loads((models[model] / "config.json").read_text()).get("tie_word_embeddings"):
        original.pop("lm_head.weight", None)
    store = WeightStore(results / case / "weights", keep=10)
    assert store.versions() == [0, 1] and store.latest() == (1, store.path(1))
    for version in (0, 1):
        path = store.path(version)
        index = json.loads((path / INDEX).read_text())
        assert sorted(index["weight_map"]) == sorted(original)
        shards = sorted(p.name for p in path.glob("*.safetensors"))
        assert sorted(set(index["weight_map"].values())) == shards
        assert {s.split("-")[1] for s in shards} == {"stage00", "stage01"}  # both stages wrote their own
        assert "model.norm.weight" in load_file(path / index["weight_map"]["model.norm.weight"])
        assert index["weight_map"]["model.embed_tokens.weight"].startswith("model-stage00-")
        assert index["weight_map"]["model.norm.weight"].startswith("model-stage01-")
        names = [name for shard in shards for name in load_file(path / shard)]
        assert sorted(names) == sorted(original)  # exactly once
        loaded = {name: t for shard in shards for name, t in load_file(path / shard).items()}
        for name, tensor in original.items():
            expected = tensor + 1.0 if version == 1 else tensor
            assert loaded[name].dtype == expected.dtype and torch.equal(loaded[name], expected), (version, name)
        assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in original.values())
        assert (path / "config.json").is_file() and not list(path.glob(".stage-*"))
        assert set(shards) <= set(json.loads((path / MANIFEST).read_text())["files"])  # each stage hashed its own
        verify_version(path, version)
    assert not [p.name for p in store.root.iterdir() if p.name.startswith(".tmp-")]
    announced = json.loads((results / case / "announced.json").read_text())
    assert announced == [[0, str(store.path(0))], [1, str(store.path(1))]]


def test_transformers_loads_a_version_published_by_stages(results, models):
    from transformers import AutoModelForCausalLM

    path = WeightStore(results / "qwen_behind" / "weights").path(1)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    original = load_file(models["qwen"] / "model.safetensors")
    assert torch.equal(model.model.layers[3].mlp.down_proj.weight, original["model.layers.3.mlp.down_proj.weight"] + 1)
    assert torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)  # tied, from the first stage's shard
