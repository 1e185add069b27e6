"""Durable renames (rft.processes.durable_replace, write_durably): every file a resume reads is fsynced, renamed into
place, and its directory fsynced, in that order, so that a power loss leaves the old file or the whole new one. The
fsync and rename calls are recorded (os.fsync and os.replace wrapped; the real calls still run)."""
from __future__ import annotations

import os

import pytest
import torch

from rft.processes import durable_replace, write_durably
from rft.trainer.checkpoint import CheckpointDir, TrainerState
from rft.trainer.feed import FeedState
from rft.weights.store import LATEST, WeightStore


@pytest.fixture
def calls(monkeypatch) -> list[tuple[str, str]]:
    """("fsync", path) and ("replace", destination) in call order."""
    log: list[tuple[str, str]] = []
    fsync, replace = os.fsync, os.replace

    def recorded_fsync(fd: int) -> None:
        log.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        fsync(fd)

    def recorded_replace(src, dst) -> None:
        replace(src, dst)
        log.append(("replace", str(dst)))

    monkeypatch.setattr(os, "fsync", recorded_fsync)
    monkeypatch.setattr(os, "replace", recorded_replace)
    return log


def synced_before_rename(calls: list[tuple[str, str]], target: str) -> tuple[int, int]:
    """(index of the rename onto `target`, index of the fsync of its directory after it)."""
    rename = calls.index(("replace", target))
    directory = calls.index(("fsync", os.path.dirname(target)), rename)
    return rename, directory


def test_write_durably_syncs_the_file_then_renames_then_syncs_the_directory(tmp_path, calls):
    target = tmp_path / "latest"
    write_durably(target, "step_000003\n")
    assert target.read_text() == "step_000003\n" and os.listdir(tmp_path) == ["latest"]
    rename, directory = synced_before_rename(calls, str(target))
    synced_files = [path for kind, path in calls[:rename] if kind == "fsync"]
    assert len(synced_files) == 1 and synced_files[0].startswith(str(tmp_path / ".latest.tmp-"))
    assert directory == rename + 1


def test_a_directory_is_synced_whole_before_its_rename(tmp_path, calls):
    staged = tmp_path / ".tmp-v1"
    (staged / "sub").mkdir(parents=True)
    for name in ("a.safetensors", "sub/b.json"):
        (staged / name).write_text(name)
    durable_replace(staged, tmp_path / "v1")
    rename, _ = synced_before_rename(calls, str(tmp_path / "v1"))
    before = {path for kind, path in calls[:rename] if kind == "fsync"}
    assert before == {str(staged), str(staged / "sub"), str(staged / "a.safetensors"), str(staged / "sub/b.json")}


def test_a_checkpoint_and_a_weight_version_are_put_in_place_durably(tmp_path, calls):
    checkpoints = CheckpointDir(tmp_path)
    step = checkpoints.step_dir(3)
    step.mkdir(parents=True)
    checkpoints.write_state(step, TrainerState(step=3, feed=FeedState(), counters={}, rng={}))
    checkpoints.commit(3)
    synced_before_rename(calls, str(step / "trainer_state.json"))
    synced_before_rename(calls, str(checkpoints.root / "latest"))
    assert calls.index(("replace", str(step / "trainer_state.json"))) < calls.index(
        ("replace", str(checkpoints.root / "latest")))

    calls.clear()
    store = WeightStore(tmp_path / "weights")
    store.publish(1, [{"a.weight": torch.zeros(2)}], hf_dir=None)
    rename, _ = synced_before_rename(calls, str(store.path(1)))
    assert any(kind == "fsync" and path.endswith(".safetensors") for kind, path in calls[:rename])
    latest, _ = synced_before_rename(calls, str(store.root / LATEST))
    assert rename < latest  # LATEST names a version that is durable already
