"""Per-stage weight publishing on the pull path at PP=2 (torchrun, gloo): each pipeline stage's publishing rank
writes its own shards into the version's staging directory and rank 0 completes the version (rft.weights).

One 2-process launch (_worker_stage_publish.py) publishes versions 0 and 1 through the trainer's own code for a
tied-embedding Qwen2 (with and without write-behind) and an untied Llama (lm_head on the last stage). Checked
here: every HF tensor of the checkpoint is in each version exactly once and bit-exact (version 1 = checkpoint
+ 1.0), each stage wrote its own shards, the index lists every shard, the announcements came in order with LATEST,
no staging leftovers, and transformers loads the version directory as an HF model. A fourth case publishes into an
S3 bucket (rft's object server) with sparse deltas, version 1 changing every 16th element: each stage's publishing
rank writes its shards and their deltas from version 0 (kept in its own store handle), and a host that holds version
0 rebuilds version 1 from the deltas alone, bit for bit.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rft.broker.objects import ObjectServer
from rft.models.tiny import make_tiny_model
from rft.weights.bucket import BucketStore
from rft.weights.store import INDEX, MANIFEST, WeightStore, verify_version
from tests.s3_servers import S3_ENV

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
def bucket(tmp_path_factory):
    """rft's object server with a bucket `stages`; the S3 credentials in this process's environment (the torchrun
    workers inherit it)."""
    saved = {key: os.environ.get(key) for key in S3_ENV}
    os.environ.update(S3_ENV)
    server = ObjectServer(tmp_path_factory.mktemp("stage-bucket") / "objects")
    server.bucket("stages")
    yield server
    server.stop()
    for key, value in saved.items():
        os.environ.pop(key) if value is None else os.environ.__setitem__(key, value)


@pytest.fixture(scope="module")
def results(models, bucket, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("stage-results")
    cases = [{"name": name, "hf_dir": str(models[model]), "write_behind": behind} for name, model, behind in CASES]
    cases.append({"name": "qwen_bucket", "hf_dir": str(models["qwen"]), "write_behind": False, "sparse": True,
                  "sync": {"weight_store": "s3://stages/qwen", "s3_endpoint": bucket.endpoint, "delta": True,
                           "keep_versions": 10, "cache_dir": str(out / "trainer-cache")}})
    spec = {"out_dir": str(out), "cases": cases}
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


def test_stages_publish_into_a_bucket_with_deltas_a_host_rebuilds_bit_for_bit(results, models, bucket, tmp_path):
    store = BucketStore("s3://stages/qwen", endpoint=bucket.endpoint, cache_dir=tmp_path / "host")
    assert store.versions() == [0, 1] and store.latest()[0] == 1
    manifest = json.loads(store.read(1, MANIFEST))
    shards = sorted(n for n in manifest["files"] if n.endswith(".safetensors"))
    assert manifest["delta"]["base"] == 0 and sorted(manifest["delta"]["files"]) == shards  # every shard had one
    assert {s.split("-")[1] for s in shards} == {"stage00", "stage01"}
    store.local(0)
    path = store.local(1)
    assert store.cache.stats["deltas_applied"] == len(shards) and store.cache.stats["delta_fallbacks"] == 0
    original = load_file(models["qwen"] / "model.safetensors")
    original.pop("lm_head.weight", None)  # tied
    loaded = {name: t for shard in shards for name, t in load_file(path / shard).items()}
    for name, tensor in original.items():
        expected = tensor.clone()
        expected.view(-1)[::16] += 1.0
        assert torch.equal(loaded[name], expected), name
    announced = json.loads((results / "qwen_bucket" / "announced.json").read_text())
    assert announced == [[0, store.location(0)], [1, store.location(1)]]


def test_transformers_loads_a_version_published_by_stages(results, models):
    from transformers import AutoModelForCausalLM

    path = WeightStore(results / "qwen_behind" / "weights").path(1)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    original = load_file(models["qwen"] / "model.safetensors")
    assert torch.equal(model.model.layers[3].mlp.down_proj.weight, original["model.layers.3.mlp.down_proj.weight"] + 1)
    assert torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)  # tied, from the first stage's shard
