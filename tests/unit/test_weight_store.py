"""WeightStore: atomic versions, LATEST only forward, garbage collection, round trip of tensors."""
from __future__ import annotations

import json

import pytest
import torch

from rft.weights.store import WeightStore, WeightStoreError, iter_safetensors


def buckets(seed: int):
    g = torch.Generator().manual_seed(seed)
    return [{"a.weight": torch.randn(3, 4, generator=g), "b.bias": torch.randn(4, generator=g)},
            {"c.weight": torch.randn(2, 2, generator=g).t()}]  # non-contiguous on purpose


def test_publish_round_trip_and_layout(tmp_path, hf_dir):
    store = WeightStore(tmp_path / "store")
    assert store.latest() is None
    expected = {k: v.clone() for b in buckets(1) for k, v in b.items()}
    path = store.publish(3, buckets(1), hf_dir)
    assert path.name == "v00000003" and store.latest() == (3, path)
    assert sorted(p.name for p in path.iterdir()) == [
        "config.json", "model-00000.safetensors", "model-00001.safetensors", "model.safetensors.index.json",
        "rft-manifest.json", "tokenizer.json"]
    index = json.loads((path / "model.safetensors.index.json").read_text())
    assert index["weight_map"] == {"a.weight": "model-00000.safetensors", "b.bias": "model-00000.safetensors",
                                   "c.weight": "model-00001.safetensors"}
    loaded = dict(store.iter_tensors(3))
    assert loaded.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(loaded[name], tensor)
    assert dict(iter_safetensors(path)).keys() == expected.keys()
    assert not [p for p in (tmp_path / "store").iterdir() if p.name.startswith(".")]  # no temp files left


def test_latest_only_moves_forward_and_republish_is_idempotent(tmp_path, hf_dir):
    store = WeightStore(tmp_path, keep=5)
    store.publish(2, buckets(1), hf_dir)
    store.publish(1, buckets(2), hf_dir)  # an older version published late
    assert store.latest()[0] == 2
    before = dict(store.iter_tensors(2))
    store.publish(2, buckets(3), hf_dir)  # same number again: the first publish stands
    assert all(torch.equal(before[k], v) for k, v in store.iter_tensors(2))


def test_garbage_collection_keeps_newest(tmp_path, hf_dir):
    store = WeightStore(tmp_path, keep=2)
    for v in range(5):
        store.publish(v, buckets(v), hf_dir)
    assert store.versions() == [3, 4]
    assert store.latest()[0] == 4
    with pytest.raises(FileNotFoundError, match="version 0 is not there"):
        store.iter_tensors(0)


def test_failed_publish_leaves_nothing_visible(tmp_path, hf_dir):
    store = WeightStore(tmp_path / "store")
    duplicated = [{"a.weight": torch.zeros(1)}, {"a.weight": torch.ones(1)}]
    with pytest.raises(WeightStoreError, match="'a.weight' appears in more than one bucket"):
        store.publish(0, duplicated, hf_dir)
    with pytest.raises(WeightStoreError, match="no config.json"):
        store.publish(0, buckets(0), tmp_path / "nowhere")
    with pytest.raises(WeightStoreError, match="no tensors"):
        store.publish(0, [], hf_dir)
    assert store.latest() is None and store.versions() == []
    assert list((tmp_path / "store").iterdir()) == []


def test_corrupt_latest_is_a_clear_error(tmp_path):
    (tmp_path / "LATEST").write_text("garbage")
    with pytest.raises(WeightStoreError, match="LATEST is corrupt"):
        WeightStore(tmp_path).latest()


# ------------------------------------------------------------------ per-stage publishing (pipeline stages)

def test_stages_write_their_own_shards_and_the_publisher_completes_the_version(tmp_path, hf_dir):
    """Stage 1 writes from another thread (on a trainer: another rank) after the publisher started waiting."""
    import threading

    store = WeightStore(tmp_path / "store")
    staging = store.stage(4, stages=2)
    assert staging.dir.is_dir() and not store.versions()
    received = staging.from_json(store.root, staging.to_json())  # as a later stage's rank gets it
    assert received == staging
    later = threading.Timer(0.2, store.write_stage, args=(received, 1, [{"d.weight": torch.ones(2)}]))
    later.start()
    path = store.publish(4, buckets(1), hf_dir, staging=staging, wait_s=5)
    later.join()
    assert store.latest() == (4, path)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    assert index["weight_map"] == {"a.weight": "model-stage00-00000.safetensors",
                                   "b.bias": "model-stage00-00000.safetensors",
                                   "c.weight": "model-stage00-00001.safetensors",
                                   "d.weight": "model-stage01-00000.safetensors"}
    assert index["metadata"]["total_size"] == (12 + 4 + 4 + 2) * 4
    assert torch.equal(dict(store.iter_tensors(4))["d.weight"], torch.ones(2))
    assert not [p for p in path.iterdir() if p.name.startswith(".")]
    assert store.stage(4, stages=2) is None  # published already


def test_a_stage_that_fails_or_never_writes_is_named_and_nothing_is_published(tmp_path, hf_dir):
    store = WeightStore(tmp_path / "store")
    staging = store.stage(1, stages=3)
    store.write_stage(staging, 2, [{"z": torch.zeros(1)}])
    with pytest.raises(WeightStoreError, match=r"version 1: pipeline stage\(s\) 1 wrote nothing to .* for 0.3 s"):
        store.publish(1, buckets(1), hf_dir, staging=staging, wait_s=0.3)
    assert not staging.dir.exists() and store.latest() is None

    staging = store.stage(1, stages=2)
    with pytest.raises(WeightStoreError, match="appears in more than one bucket"):
        store.write_stage(staging, 1, [{"a": torch.zeros(1)}, {"a": torch.zeros(1)}])
    with pytest.raises(WeightStoreError, match="pipeline stage 1 failed to write its shards: .*more than one bucket"):
        store.publish(1, buckets(1), hf_dir, staging=staging, wait_s=5)

    staging = store.stage(1, stages=2)
    store.write_stage(staging, 1, [{"a.weight": torch.zeros(1)}])
    with pytest.raises(WeightStoreError, match="'a.weight' comes from pipeline stages 0 and 1"):
        store.publish(1, buckets(1), hf_dir, staging=staging, wait_s=5)
    assert store.versions() == [] and list(store.root.iterdir()) == []
    with pytest.raises(WeightStoreError, match="staging directory .* is not there"):
        store.write_stage(staging, 1, [{"a.weight": torch.zeros(1)}])


def test_an_adapter_version_is_the_peft_directory_and_its_manifest(tmp_path, hf_dir):
    from rft.weights.store import (
        ADAPTER_CONFIG,
        ADAPTER_FILE,
        MANIFEST,
        is_adapter_version,
        read_adapter,
        verify_version,
    )

    store = WeightStore(tmp_path / "store")
    a, b = torch.randn(2, 4), torch.randn(3, 2)
    prefix = "base_model.model.model.layers.0.self_attn.o_proj"
    config = {"peft_type": "LORA", "r": 2, "lora_alpha": 4.0}
    path = store.publish(1, [{f"{prefix}.lora_A.weight": a}, {f"{prefix}.lora_B.weight": b}], hf_dir,
                         adapter_config=config)
    assert sorted(p.name for p in path.iterdir()) == sorted([ADAPTER_CONFIG, ADAPTER_FILE, MANIFEST])
    verify_version(path, 1)
    assert is_adapter_version(path) and store.latest() == (1, path)
    read_config, pairs = read_adapter(path)
    assert read_config == config and list(pairs) == ["model.layers.0.self_attn.o_proj"]
    assert torch.equal(pairs["model.layers.0.self_attn.o_proj"][0], a)
    staging = store.stage(2, stages=2)
    with pytest.raises(WeightStoreError, match="written whole by one rank"):
        store.publish(2, [], hf_dir, staging=staging, adapter_config=config)
