"""The control topic is not trusted (rft.weights.subscriber, docs/operations.md "Trust"): a forged or corrupted
`weights` announcement or version, and a push group at an address that is not allowed, are refused, counted, and
the engine keeps its weights. Real files in a real WeightStore; announcements through the in-memory transport."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from rft.tensors import all_finite
from rft.transport.control import PushGroup, Weights
from rft.transport.memory import MemoryTransport
from rft.weights.store import MANIFEST, WeightStore, WeightStoreError, first_non_finite, verify_version
from rft.weights.subscriber import PushAllowList, PushMembership, WeightUpdates, load_newest_weights

CONTROL = "run.control"


def buckets(seed: int):
    g = torch.Generator().manual_seed(seed)
    return [{"a.weight": torch.randn(64, 64, generator=g)}, {"b.bias": torch.randn(64, generator=g)}]


class Engine:
    """Loads nothing; remembers what it was asked to load."""

    def __init__(self):
        self.weights_version, self.loads, self.joined = 0, [], []

    def load_weights(self, path, version: int) -> None:
        self.loads.append((version, str(path)))
        self.weights_version = version

    def join_push_group(self, spec: dict) -> None:
        self.joined.append(spec["group_id"])


@pytest.fixture
def run(tmp_path):
    """A store with version 1 published and loaded by an explorer; `announce` writes to the control topic."""
    transport = MemoryTransport()
    transport.admin().create_topics([CONTROL])
    sink = transport.sink()
    source = transport.source()
    source.assign([CONTROL])
    store = WeightStore(tmp_path / "store", keep=10)
    updates, engine = WeightUpdates(store, source), Engine()
    store.publish(1, buckets(1), hf_dir=None)
    assert load_newest_weights(engine, lambda: updates.newest(above=engine.weights_version))[0] == 1

    def announce(kind) -> None:
        sink.send_record(CONTROL, kind.to_message())
        sink.flush()

    def step():
        return load_newest_weights(engine, lambda: updates.newest(above=engine.weights_version))

    return store, updates, engine, announce, step


def test_a_published_version_has_a_manifest_of_every_file(tmp_path):
    store = WeightStore(tmp_path / "store")
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    path = store.publish(2, buckets(2), hf_dir=hf)
    manifest = json.loads((path / MANIFEST).read_text())
    assert manifest["version"] == 2 and manifest["algorithm"] == "sha256"
    assert sorted(manifest["files"]) == sorted(p.name for p in path.iterdir() if p.name != MANIFEST)
    assert all(e["size"] == (path / n).stat().st_size for n, e in manifest["files"].items())
    verify_version(path, 2)
    with pytest.raises(WeightStoreError, match="for version 2, not 3"):
        verify_version(path, 3)


def test_per_stage_shards_are_in_the_manifest(tmp_path):
    store = WeightStore(tmp_path / "store")
    staging = store.stage(4, stages=2)
    store.write_stage(staging, 1, [{"late.weight": torch.ones(8, 8)}])
    path = store.publish(4, [{"early.weight": torch.zeros(8)}], hf_dir=None, staging=staging)
    files = json.loads((path / MANIFEST).read_text())["files"]
    assert {"model-stage00-00000.safetensors", "model-stage01-00000.safetensors"} <= set(files)
    verify_version(path, 4)
    with open(path / "model-stage01-00000.safetensors", "r+b") as f:  # flip one byte of the later stage's shard
        f.seek(-1, os.SEEK_END)
        last = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last[0] ^ 0xFF]))
    with pytest.raises(WeightStoreError, match="sha256 does not match"):
        verify_version(path, 4)
    verify_version(path, 4, checksums=False)  # sizes only


def forged_elsewhere(tmp_path, store, version):
    """A complete, self-consistent version directory outside the store."""
    other = WeightStore(tmp_path / "elsewhere", keep=10)
    return other.publish(version, buckets(666), hf_dir=None)


@pytest.mark.parametrize("forgery", ["dotdot", "absolute", "symlinked_version", "symlinked_file"])
def test_a_forged_path_is_refused_counted_and_the_weights_kept(tmp_path, run, forgery):
    store, updates, engine, announce, step = run
    evil = forged_elsewhere(tmp_path, store, 2)
    if forgery == "dotdot":
        path = str(store.root / ".." / "elsewhere" / "v00000002")
    elif forgery == "absolute":
        path = str(evil)
    elif forgery == "symlinked_version":
        os.symlink(evil, store.path(2))
        path = str(store.path(2))
    else:  # a real version directory whose shard is a symlink out of the store
        good = store.publish(2, buckets(2), hf_dir=None)
        os.remove(good / "model-00000.safetensors")
        os.symlink(evil / "model-00000.safetensors", good / "model-00000.safetensors")
        path = str(good)
    announce(Weights(version=2, path=path))
    assert step() is None
    assert engine.weights_version == 1 and engine.loads[-1][0] == 1
    assert updates.refused == 1
    assert step() is None and updates.refused == 1  # refused once, not again every batch


@pytest.mark.parametrize("damage", ["truncated", "checksum", "no_manifest", "extra_weights"])
def test_a_corrupted_version_is_refused_counted_and_the_weights_kept(run, damage):
    store, updates, engine, announce, step = run
    path = store.publish(2, buckets(2), hf_dir=None)
    shard = path / "model-00000.safetensors"
    if damage == "truncated":
        shard.write_bytes(shard.read_bytes()[:-100])
    elif damage == "checksum":
        data = bytearray(shard.read_bytes())
        data[-1] ^= 0xFF
        shard.write_bytes(bytes(data))
    elif damage == "no_manifest":
        (path / MANIFEST).unlink()
    else:
        (path / "model-99999.safetensors").write_bytes(b"smuggled")
    announce(Weights(version=2, path=str(path)))
    assert step() is None
    assert engine.weights_version == 1 and updates.refused == 1
    path3 = store.publish(3, buckets(3), hf_dir=None)  # the next good version is loaded
    announce(Weights(version=3, path=str(path3)))
    assert step()[0] == 3 and engine.loads[-1] == (3, str(path3.resolve()))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_a_poisoned_version_is_refused_counted_and_the_weights_kept(run, bad):
    store, updates, engine, announce, step = run
    poisoned = buckets(2)
    poisoned[1]["b.bias"][17] = bad  # a manifest and checksums that match: only the values are wrong
    path = store.publish(2, poisoned, hf_dir=None)
    with pytest.raises(WeightStoreError, match="tensor b.bias holds NaN or infinity"):
        verify_version(path, 2)
    announce(Weights(version=2, path=str(path)))
    assert step() is None
    assert engine.weights_version == 1 and updates.refused == 1


def test_all_finite_agrees_with_numpy_isfinite():
    """The min/max reduction against numpy's elementwise test, one bad value anywhere, in every float dtype."""
    g = torch.Generator().manual_seed(0)
    dtypes = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
    values = [None, float("nan"), float("inf"), float("-inf")]  # None: every value finite
    for trial in range(4 * 4 * 3 * 5):  # each dtype x value x tensor, 5 random positions
        dtype, value, which = dtypes[trial % 4], values[trial // 4 % 4], [0, 1, 3][trial // 16 % 3]
        tensors = [torch.randn(shape, generator=g).to(dtype) for shape in [(7, 33), (), (0,), (1000,)]]
        if value is not None:  # tensors[1] is 0-d, tensors[2] empty
            tensors[which].view(-1)[int(torch.randint(tensors[which].numel(), (1,), generator=g))] = value
        expected = all(bool(np.isfinite(t.float().numpy()).all()) for t in tensors)
        assert expected == (value is None)
        assert all_finite(tensors) == expected, trial
        named = [(f"t{i}", t) for i, t in enumerate(tensors)]
        assert first_non_finite(named) == next((n for n, t in named if not np.isfinite(t.float().numpy()).all()), None)
    assert all_finite([]) and all_finite([torch.tensor([1, 2])])  # integer tensors hold no NaN


def test_a_path_not_on_this_host_names_the_version_in_this_store(run):
    store, updates, engine, announce, step = run
    path = store.publish(2, buckets(2), hf_dir=None)
    (store.root / "LATEST").write_text("1\n")  # only the announcement tells
    announce(Weights(version=2, path="/mnt/trainer-side/weights/v00000002"))
    assert step()[0] == 2 and engine.loads[-1] == (2, str(path.resolve())) and updates.refused == 0


def test_a_forged_push_group_address_is_refused_counted_and_not_joined(run):
    store, updates, engine, announce, step = run
    membership = PushMembership(engine, updates, allowed=PushAllowList(["127.0.0.1"], port=29555))
    group = dict(world_size=2, backend="gloo", timeout_s=1.0)
    announce(PushGroup(group_id="evil", host="203.0.113.9", port=29555, **group))
    assert membership.sync() == [] and membership.group_id is None and updates.refused == 1
    announce(PushGroup(group_id="wrong-port", host="127.0.0.1", port=1234, **group))
    assert membership.sync() == [] and membership.group_id is None and updates.refused == 2
    assert membership.sync() == [] and updates.refused == 2  # each refused once
    announce(PushGroup(group_id="other-run", host="localhost", port=29555, lineage="f" * 32, **group))
    assert membership.sync() == [] and membership.group_id is None and updates.refused == 3  # another lineage's
    announce(PushGroup(group_id="good", host="localhost", port=29555, lineage=store.read_lineage().id, **group))
    assert membership.sync() == [] and membership.group_id == "good" and engine.joined == ["good"]
    assert engine.weights_version == 1


def test_the_default_allow_list_is_the_push_host_else_this_host():
    from rft.weights.config import SyncConfig

    spec = dict(group_id="g", port=5, world_size=2, backend="gloo", timeout_s=1.0)
    local = PushAllowList.for_sync(SyncConfig(method="push"))
    assert local.problem(PushGroup(host="127.0.0.1", **spec)) is None
    assert "not allowed" in local.problem(PushGroup(host="198.51.100.7", **spec))
    named = PushAllowList.for_sync(SyncConfig(method="push", push_host="198.51.100.7", push_port=5))
    assert named.problem(PushGroup(host="198.51.100.7", **spec)) is None
    assert "not allowed" in named.problem(PushGroup(host="127.0.0.1", **spec))
    listed = PushAllowList.for_sync(SyncConfig(method="push", push_allow=["198.51.100.7", "198.51.100.8"]))
    assert listed.problem(PushGroup(host="198.51.100.8", **spec)) is None


def test_an_explorer_refuses_a_forged_announcement_and_reports_the_count(tmp_path):
    """The real Explorer over the in-memory transport: a forged `weights` announcement (a complete version outside
    the store) is refused, the engine keeps its version, and the count is in the explorer's heartbeat."""
    from rft.explorer.config import ExplorerConfig
    from rft.explorer.explorer import Explorer
    from rft.transport.config import KafkaConfig
    from rft.transport.control import ExplorerHeartbeat, control_messages, parse
    from rft.transport.run_topics import RunTopics, create_run_topics
    from rft.weights.config import SyncConfig

    topics = RunTopics(run="run", tasks="run.tasks", experiences="run.experiences", control="run.control",
                       dead_letter="run.dead_letter", explorers_group="run.explorers")
    transport = MemoryTransport(partitions=1)
    kafka = KafkaConfig(bootstrap_servers="memory", partitions=1)
    create_run_topics(topics, kafka, transport)
    store = WeightStore(tmp_path / "store")
    store.publish(1, buckets(1), hf_dir=None)
    engine = Engine()
    explorer = Explorer(ExplorerConfig(heartbeat_s=0.05), kafka=kafka, sync=SyncConfig(), topics=topics, store=store,
                        explorer_id="e1", engine=engine, workflow=None, transport=transport)
    try:
        explorer.refresh_weights()
        assert engine.weights_version == 1
        explorer.join()
        evil = forged_elsewhere(tmp_path, store, 5)
        sink = transport.sink()
        sink.send_record(topics.control, Weights(version=5, path=str(evil)).to_message())
        sink.flush()
        explorer.refresh_weights()
        assert engine.weights_version == 1 and explorer.stats.weights_refused == 1
        source = transport.source()
        source.assign([topics.control])
        counts: list[int | None] = []
        for _ in range(100):  # heartbeats every 0.05 s: the ones after the refusal carry the count
            counts += [k.weights_refused for m in control_messages(source.poll(timeout_s=0.05))
                       if isinstance(k := parse(m), ExplorerHeartbeat)]
            if 1 in counts:
                break
        assert 1 in counts and set(counts) <= {0, 1}
    finally:
        explorer.close("stopped")
