"""A push that fails in the middle of a version, in a multi-rank trainer: the bucket export is a collective (every
rank takes part in each parameter's gathers and point-to-point sends), so rank 0 must not simply stop reading it.
Real processes throughout: a two-rank trainer under torchrun (gloo, PP=2, the tiny Qwen2), its real push group, and
an explorer worker process that is killed (SIGKILL) while a version streams to it (_worker_push_abort.py)."""
from __future__ import annotations

import json
import signal
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _launch import HERE, assert_succeeded, torchrun  # noqa: E402

pytestmark = pytest.mark.distributed

TIMEOUT_S = 20.0  # sync.timeout_s: the push group's deadline (a killed peer fails the push at once, well within it)


def test_an_explorer_killed_mid_push_makes_every_trainer_rank_redo_the_version_by_pull(tiny_model, tmp_path):
    spec = {"hf_dir": str(tiny_model), "out_dir": str(tmp_path), "bucket_bytes": 32 << 10, "timeout_s": TIMEOUT_S}
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    started = time.monotonic()
    # a trainer rank left in the export's collectives would hang until the trainer group's own timeout (a minute)
    assert_succeeded(torchrun([str(HERE / "_worker_push_abort.py"), str(tmp_path / "spec.json")], timeout=150))
    result = json.loads((tmp_path / "result.json").read_text())
    received = json.loads((tmp_path / "received.json").read_text())

    assert received["version"] == 0 and received["tensors"] > 0  # version 0 arrived by push ...
    assert result["explorer_exit"] == -signal.SIGKILL  # ... then the explorer died during version 1's push
    announced = [kind for kind in result["announced"] if kind != "PushGroupSpec"]
    assert announced == ["WeightsPush", "WeightsPush", "PushAbandoned", "Weights"]
    assert result["method"] == "pull" and result["stored"] == [1]  # version 1 redone by the pull path
    assert result["seconds"] < TIMEOUT_S  # the lost peer failed the push at once: no rank waited for a timeout
    print(f"two versions (one failed push redone by pull) in {result['seconds']:.1f} s; "
          f"whole launch {time.monotonic() - started:.1f} s")
