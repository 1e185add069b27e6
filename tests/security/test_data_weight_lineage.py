"""Weights that know their run (rft.weights.store, "Lineage"; docs/security.md): a weight store's versions carry its
lineage, so another run's version N is never loaded for this run's N.

Attacks: a stale host cache (`sync.cache_dir`) that holds another run's version N of the same bucket prefix; a reused
store prefix where another lineage's version directory is put back; a trainer started with `--no-resume` on a used
store (before: it re-published its versions as no-ops over the old run's, and the bounded modes livelocked on them).
Real parts: rft's object server for the bucket store, real directories, the trainer's loop with the stand-in policy
and the in-memory transport of tests/unit/test_trainer_loop.py.
"""
from __future__ import annotations

import dataclasses
import json
import shutil

import pytest
import torch

from rft.trainer.main import Trainer, open_trainer_io
from rft.transport.memory import MemoryTransport
from rft.weights.bucket import BucketStore
from rft.weights.store import LINEAGE, MANIFEST, Lineage, LineageError, WeightStore, claim_lineage, iter_safetensors
from rft.weights.subscriber import WeightUpdates
from tests.records import make_group
from tests.s3_servers import S3_ENV, S3Server
from tests.unit.test_trainer_loop import StandInPolicy, fill, make_config


def weights(value: float) -> list[dict]:
    return [{"a.weight": torch.full((8, 8), value)}]


def tensor(path) -> float:
    return float(dict(iter_safetensors(path))["a.weight"][0, 0])


def test_a_stale_host_cache_never_serves_another_runs_version(tmp_path, monkeypatch):
    for key, value in S3_ENV.items():
        monkeypatch.setenv(key, value)
    server = S3Server("rft-objects", tmp_path / "s3")
    try:
        server.bucket("weights")
        url, cache = "s3://weights/run", tmp_path / "cache"

        def store() -> BucketStore:
            return BucketStore(url, cache_dir=cache, endpoint=server.endpoint, keep=4)

        old_run = store()
        for version in (0, 1):
            old_run.publish(version, weights(1.0 + version), hf_dir=None)
        old_reader = store()
        assert tensor(old_reader.local(1)) == 2.0  # the old run's version 1, in this host's cache

        new_run = store()  # the prefix reused by another run, which starts a new lineage explicitly
        with pytest.raises(LineageError, match="sync.new_lineage"):
            claim_lineage(new_run, "other", checkpoint=None, resumed=False, resume=True, new=False)
        claim_lineage(new_run, "other", checkpoint=None, resumed=False, resume=True, new=True)
        assert new_run.versions() == [] and new_run.latest() is None  # the old versions are gone from the store
        for version in (0, 1):
            new_run.publish(version, weights(10.0 + version), hf_dir=None)

        reader = store()
        assert tensor(reader.local(1)) == 11.0  # not the cached 2.0 of the other lineage
        assert reader.cache.stats["foreign_removed"] >= 1
        manifest = json.loads((reader.local(1) / MANIFEST).read_text())
        assert manifest["lineage"] == new_run.read_lineage().id and manifest["run"] == "other"
        with pytest.raises(LineageError, match="another run took the store"):
            old_reader.local(1)  # a reader of the old run refuses the new lineage's versions
    finally:
        server.stop()


def test_a_reused_store_prefix_loads_no_version_of_the_old_lineage(tmp_path):
    root = tmp_path / "store"
    old = WeightStore(root, keep=10)
    for version in range(3):
        old.publish(version, weights(float(version)), hf_dir=None)
    kept = tmp_path / "old-v2"
    shutil.copytree(old.path(2), kept)

    new = WeightStore(root, keep=10)
    claim_lineage(new, "other", checkpoint=None, resumed=False, resume=False, new=True)
    new.publish(0, weights(100.0), hf_dir=None)
    shutil.copytree(kept, root / "v00000002")  # the old lineage's version 2, put back under the new lineage

    class NoAnnouncements:
        def poll(self, timeout_s: float = 1.0, max_records=None):
            return []

        def close(self) -> None:
            pass

    updates = WeightUpdates(WeightStore(root), NoAnnouncements())
    assert updates._trusted(2, root / "v00000002") is None and updates.refused == 1
    assert updates._trusted(0, root / "v00000000", "f" * 32) is None and updates.refused == 2  # announced for another
    assert updates._trusted(0, root / "v00000000", new.pin.lineage.id) == root / "v00000000"
    with pytest.raises(LineageError, match="a version of lineage"):
        WeightStore(root).local(2)
    assert tensor(WeightStore(root).local(0)) == 100.0


def build(cfg, transport: MemoryTransport, *, resume: bool = True) -> Trainer:
    return Trainer(cfg.trainer, run=cfg.run, model=cfg.model, algorithm=cfg.algorithm, sync=cfg.sync,
                   run_dir=cfg.run_dir, temperature=1.0, progress=False, policy=StandInPolicy([]), resume=resume,
                   open_io=lambda feed_state, replay_state: open_trainer_io(
                       cfg, feed_state=feed_state, replay_state=replay_state, transport=transport))


def test_no_resume_on_a_used_store_is_refused_unless_a_new_lineage_is_asked_for(tmp_path):
    cfg = make_config(tmp_path)
    transport = MemoryTransport(partitions=1)
    fill(transport, cfg, [make_group("run", i, n_samples=2, policy_version=i // 3) for i in range(6)])
    first = build(cfg, transport)
    try:
        first.run()
    finally:
        first.close()
    store = WeightStore.for_sync(cfg.sync, cfg.run_dir)
    lineage = Lineage.from_json((store.root / LINEAGE).read_text(), "LINEAGE")
    state = json.loads((cfg.run_dir / "checkpoints" / "step_000003" / "trainer_state.json").read_text())
    assert state["lineage"] == lineage.id and lineage.run == "run"

    with pytest.raises(LineageError, match="holds lineage .*--no-resume.*sync.new_lineage: true"):
        build(cfg, transport, resume=False)
    assert store.latest()[0] == 3 and store.read_lineage() == lineage  # refused: nothing touched

    resumed = build(cfg, transport)  # a resumed trainer continues its lineage
    assert resumed.lineage == lineage.id and resumed.step == 3
    resumed.close()

    fresh_cfg = dataclasses.replace(cfg, sync=dataclasses.replace(cfg.sync, new_lineage=True),
                                    run=dataclasses.replace(cfg.run, max_steps=1))
    fill(transport, cfg, [make_group("run", i, n_samples=2, policy_version=0) for i in range(6, 8)])
    fresh = build(fresh_cfg, transport, resume=False)
    try:
        assert fresh.lineage != lineage.id and store.versions() == [] and store.latest() is None
        fresh.run()
    finally:
        fresh.close()
    assert store.latest()[0] == 1
    assert json.loads((store.path(1) / MANIFEST).read_text())["lineage"] == fresh.lineage
