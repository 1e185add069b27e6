"""The weight store on S3 (rft.weights.bucket) against two real S3 servers over HTTP: rft's object server and moto's
(tests/s3_servers.py). The directory store's contract, on a bucket: manifest last and complete before visible, LATEST
only forward by conditional writes (racing writers included), garbage collection, per-stage publishing; a host's
cache (rft.weights.cache) that several processes share and that fetches each version once; sparse deltas rebuilt bit
for bit, with the full file fetched when a delta is damaged or forged."""
from __future__ import annotations

import json
import subprocess
import sys
import threading

import obstore
import pytest
import torch

from rft.weights.bucket import BucketStore
from rft.weights.store import MANIFEST, Staging, WeightStoreError, iter_safetensors
from tests.s3_servers import KINDS, S3_ENV, S3Server
from tests.waiting import wait_until

pytestmark = pytest.mark.integration


@pytest.fixture(params=KINDS)
def s3(request, tmp_path, monkeypatch):
    for key, value in S3_ENV.items():
        monkeypatch.setenv(key, value)
    server = S3Server(request.param, tmp_path / "s3")
    server.bucket("weights")
    yield server
    server.stop()


def open_bucket(s3, tmp_path, **kw) -> BucketStore:
    return BucketStore("s3://weights/runs/r1", endpoint=s3.endpoint, cache_dir=tmp_path / kw.pop("cache", "cache"),
                       **kw)


def buckets(seed: int, dtype=torch.float32) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [{"a.weight": torch.randn(64, 32, generator=g).to(dtype), "b.bias": torch.randn(32, generator=g).to(dtype)},
            {"c.weight": torch.randn(48, 16, generator=g).to(dtype).t()}]  # non-contiguous on purpose


def trained(previous: list[dict], seed: int) -> list[dict]:
    """The next version as a training step changes it: a few percent of the elements move."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for bucket in previous:
        new = {}
        for name, tensor in bucket.items():
            moved = torch.rand(tensor.shape, generator=g) < 0.04
            new[name] = torch.where(moved, tensor + 0.05 * torch.randn(tensor.shape, generator=g).to(tensor.dtype),
                                    tensor).contiguous()
        out.append(new)
    return out


def flat(bucket_list) -> dict[str, torch.Tensor]:
    return {k: v for b in bucket_list for k, v in b.items()}


def assert_holds(path, bucket_list) -> None:
    loaded, expected = dict(iter_safetensors(path)), flat(bucket_list)
    assert loaded.keys() == expected.keys()
    assert all(torch.equal(loaded[k], v) for k, v in expected.items())


def test_versions_latest_and_garbage_collection(s3, tmp_path, hf_dir):
    store = open_bucket(s3, tmp_path, keep=2)
    assert store.latest() is None and store.versions() == []
    for v in range(4):
        assert store.publish(v, buckets(v), hf_dir) == f"s3://weights/runs/r1/v{v:08d}"
    assert store.versions() == [2, 3] and store.latest() == (3, "s3://weights/runs/r1/v00000003")
    assert store.publish(3, buckets(99), hf_dir) == store.location(3)  # re-publishing is a no-op
    store.publish(1, buckets(1), hf_dir)  # an older version, late: LATEST stays
    assert store.latest()[0] == 3
    path = store.local(3, store.location(3))
    assert path.name == "v00000003" and sorted(p.name for p in path.iterdir()) == [
        "config.json", "model-00000.safetensors", "model-00001.safetensors", "model.safetensors.index.json",
        "rft-manifest.json", "tokenizer.json"]
    assert_holds(path, buckets(3))
    with pytest.raises(WeightStoreError, match="is not version 3's location"):
        store.local(3, "s3://weights/elsewhere/v00000003")  # an announcement naming another place is refused
    with pytest.raises(FileNotFoundError):
        store.local(0)  # collected
    keys = [m["path"] for chunk in obstore.list(store.objects) for m in chunk]
    assert not [k for k in keys if k.startswith(("v00000000/", "v00000001/")) or ".stage-" in k]


def test_latest_never_goes_back_under_racing_writers(s3, tmp_path):
    """Four writers advance LATEST at once, each through its versions in its own order: compare-and-swap by ETag
    keeps the largest."""
    stores = [open_bucket(s3, tmp_path, cache=f"cache{i}") for i in range(4)]
    orders = [list(range(i, 40, 4)) for i in range(4)]
    orders[1].reverse()
    errors = []

    def advance(store, order):
        try:
            for v in order:
                store.writer.advance_latest(v)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=advance, args=pair) for pair in zip(stores, orders, strict=True)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and stores[0].read_latest()[0] == 39


def test_a_version_without_its_manifest_is_invisible_then_collected(s3, tmp_path, hf_dir):
    store = open_bucket(s3, tmp_path)
    store.publish(4, buckets(4), hf_dir)
    obstore.put(store.objects, "v00000005/model-00000.safetensors", b"half a publish")  # a writer that died
    assert store.versions() == [4] and not store.has(5)
    with pytest.raises(FileNotFoundError):
        store.local(5)
    store.publish(6, buckets(6), hf_dir)
    assert store.keys("v00000005/") == [] and store.versions() == [4, 6]


@pytest.mark.parametrize("damage", ["rewritten", "manifest-for-another-version"])
def test_a_damaged_version_is_refused_and_nothing_is_cached(s3, tmp_path, hf_dir, damage):
    store = open_bucket(s3, tmp_path)
    store.publish(1, buckets(1), hf_dir)
    if damage == "rewritten":
        obstore.put(store.objects, "v00000001/model-00001.safetensors", store.read(1, "model-00000.safetensors"))
        match = "model-00001.safetensors does not match the manifest"
    else:
        manifest = json.loads(store.read(1, MANIFEST))
        obstore.put(store.objects, f"v00000001/{MANIFEST}", json.dumps({**manifest, "version": 7}).encode())
        match = "is not version 1's manifest"
    with pytest.raises(WeightStoreError, match=match):
        store.local(1)
    assert store.cache.versions() == [] and not list((tmp_path / "cache").rglob("*.safetensors"))


def test_stages_write_their_own_shards_into_the_bucket(s3, tmp_path, hf_dir):
    publisher, stage1 = open_bucket(s3, tmp_path), open_bucket(s3, tmp_path, cache="cache1")
    staging = publisher.stage(2, stages=2)
    remote = stage1.staging_from_json(staging.to_json())  # as another rank receives it
    writer = threading.Thread(target=stage1.write_stage, args=(remote, 1, [{"late.weight": torch.ones(3)}]))
    writer.start()
    publisher.publish(2, [{"early.weight": torch.zeros(2)}], hf_dir, staging=staging, wait_s=30)
    writer.join()
    index = json.loads((publisher.local(2) / "model.safetensors.index.json").read_text())
    assert index["weight_map"] == {"early.weight": "model-stage00-00000.safetensors",
                                   "late.weight": "model-stage01-00000.safetensors"}
    assert not [k for k in publisher.keys("v00000002/") if ".stage-" in k]
    failed = Staging(version=3, dir=publisher.stage(3, 2).dir, stages=2)
    obstore.put(publisher.objects, "v00000003/.stage-01.failed", b"OSError: disk full")
    with pytest.raises(WeightStoreError, match="pipeline stage 1 failed to write its shards: OSError: disk full"):
        publisher.publish(3, [{"early.weight": torch.zeros(2)}], hf_dir, staging=failed, wait_s=30)
    assert not publisher.has(3) and publisher.keys("v00000003/") == []


def test_deltas_rebuild_each_version_and_a_damaged_delta_falls_back_to_the_full_file(s3, tmp_path, hf_dir):
    store = open_bucket(s3, tmp_path, delta=True, full_every=3)
    versions = {1: buckets(1, torch.bfloat16)}
    for v in (2, 3, 4, 5):
        versions[v] = trained(versions[v - 1], seed=v)
    store.publish(1, versions[1], hf_dir)
    store.local(1)
    store.publish(2, versions[2], hf_dir)
    manifest = json.loads(store.read(2, MANIFEST))
    assert manifest["delta"]["base"] == 1 and set(manifest["delta"]["files"]) == {"model-00000.safetensors",
                                                                                  "model-00001.safetensors"}
    assert all(e["size"] < 0.5 * manifest["files"][f]["size"] for f, e in manifest["delta"]["files"].items())
    assert_holds(store.local(2), versions[2])  # rebuilt from version 1 and the deltas, checked against the manifest
    assert s3.gets("v00000002/model-00000.safetensors") == s3.gets("v00000002/model-00001.safetensors") == 0
    assert s3.gets("v00000002/model-00000.safetensors.delta") == 1
    # config, tokenizer and index did not change: linked from version 1 in the cache
    assert store.cache.stats["deltas_applied"] == 2 and store.cache.stats["files_linked"] == 3

    store.publish(3, versions[3], hf_dir)  # 3 % full_every == 0: a full version, no delta
    assert "delta" not in json.loads(store.read(3, MANIFEST))
    assert_holds(store.local(3), versions[3])

    # version 4: one delta damaged in the bucket (its checksum no longer matches), one forged to match its entry but
    # rebuild a wrong file (a delta from another base): both fall back to the full file, and the result is exact
    store.publish(4, versions[4], hf_dir)
    damaged = bytearray(store.read(4, "model-00000.safetensors.delta"))
    damaged[-1] ^= 0xFF
    obstore.put(store.objects, "v00000004/model-00000.safetensors.delta", bytes(damaged))
    other = BucketStore("s3://weights/other", endpoint=s3.endpoint, cache_dir=tmp_path / "x", delta=True)
    other.publish(1, [versions[1][0], trained(versions[3], 9)[1]], hf_dir)
    other.publish(2, [versions[2][0], versions[4][1]], hf_dir)
    forged = other.read(2, "model-00001.safetensors.delta")
    obstore.put(store.objects, "v00000004/model-00001.safetensors.delta", forged)
    manifest = json.loads(store.read(4, MANIFEST))
    manifest["delta"]["files"]["model-00001.safetensors"] = json.loads(other.read(2, MANIFEST))["delta"]["files"][
        "model-00001.safetensors"]
    obstore.put(store.objects, f"v00000004/{MANIFEST}", json.dumps(manifest).encode())
    before = dict(store.cache.stats)
    assert_holds(store.local(4), versions[4])
    assert store.cache.stats["delta_fallbacks"] - before["delta_fallbacks"] == 2
    assert store.cache.stats["files_downloaded"] - before["files_downloaded"] == 2
    assert s3.gets("v00000004/model-00000.safetensors") == s3.gets("v00000004/model-00001.safetensors") == 1


def test_the_explorers_of_a_host_fetch_each_version_once(s3, tmp_path, hf_dir):
    """Three processes ask the shared cache for the same version at the same moment (released together: each blocks
    reading its stdin until the test writes a line to all three): the flock lets one download it; the others find it
    built. Counted from the server's request log."""
    store = open_bucket(s3, tmp_path)
    store.publish(7, buckets(7), hf_dir)
    reader = ("import sys, pathlib\n"
              "from rft.weights.bucket import BucketStore\n"
              "store = BucketStore('s3://weights/runs/r1', endpoint=sys.argv[1], cache_dir=sys.argv[2])\n"
              "pathlib.Path(sys.argv[3]).touch()\n"
              "sys.stdin.readline()\n"
              "print(store.local(7))\n")
    env = {**__import__("os").environ, **S3_ENV}
    readers = [subprocess.Popen([sys.executable, "-c", reader, s3.endpoint, str(tmp_path / "shared"),
                                 str(tmp_path / f"ready{i}")], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                text=True)
               for i in range(3)]
    wait_until(lambda: all((tmp_path / f"ready{i}").exists() for i in range(3)), timeout=60,
               what="three readers ready", alive=readers)
    for r in readers:  # the go: each reader's readline returns
        r.stdin.write("go\n")
        r.stdin.flush()
    paths = {r.communicate(timeout=120)[0].strip() for r in readers}
    assert [r.returncode for r in readers] == [0, 0, 0] and len(paths) == 1
    for shard in ("model-00000.safetensors", "model-00001.safetensors", "tokenizer.json"):
        assert s3.gets(f"v00000007/{shard}") == 1, shard
    assert_holds(paths.pop(), buckets(7))


def test_a_cached_version_left_short_is_fetched_again(s3, tmp_path, hf_dir):
    """A crash after the rename (the page cache not yet on disk) can leave a cached file short: the size check on
    every lookup catches it and the version is built again from the bucket."""
    store = open_bucket(s3, tmp_path)
    store.publish(1, buckets(1), hf_dir)
    path = store.local(1)
    shard = path / "model-00000.safetensors"
    shard.write_bytes(shard.read_bytes()[:100])
    assert store.local(1) == path and s3.gets("v00000001/model-00000.safetensors") == 2
    assert_holds(path, buckets(1))
