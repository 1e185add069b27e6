"""Each algorithm of the REINFORCE-family catalog (reinforce, sapo, topr, sppo, opmd, asymre, rec, raft, and remax,
whose groups carry the greedy response's reward), gigpo (per-token advantages from its samples' turns; one sample
failed, left out by the feed and counted), the
whole-batch ones (m2po, clip_b, clip_v: the pass at the step's start, then their global masks) and jsd_distill (the
tiny model its own teacher) trains two steps through the real trainer (torchrun, 2 processes, data parallel 2, gloo,
the tiny model; _worker_algorithm_catalog.py, one process pair for all of them): its keys load with a run's config,
its loss and metrics come back from both ranks, and the weights move. The formulas themselves:
tests/unit/test_algorithms_catalog.py, tests/unit/test_algorithms_whole_batch.py, tests/unit/test_algorithms_remax.py.
"""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

from rft.models.tiny import make_tiny_model

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _launch import run_worker_on  # noqa: E402
from _worker_algorithm_catalog import ALGORITHMS  # noqa: E402

pytestmark = pytest.mark.distributed

# a metric each algorithm's own loss reports (None: only the common ones)
OWN_METRIC = {"reinforce": "clip_frac", "sapo": "sapo_gate_mean", "topr": "topr_alpha_mean", "sppo": "clip_frac",
              "opmd": None, "asymre": None, "rec": "clip_frac", "raft": "raft_kept_frac", "remax": "clip_frac",
              "m2po": "m2po_ratio_mean",
              "clip_b": "entropy_clip_frac", "clip_v": "entropy_clip_frac", "jsd_distill": "teacher_jsd",
              "gigpo": "clip_frac"}


@pytest.fixture(scope="module")
def metrics(tmp_path_factory) -> dict[str, list[dict]]:
    model = make_tiny_model(tmp_path_factory.mktemp("catalog-model") / "qwen", seed=9)
    out = run_worker_on("_worker_algorithm_catalog.py", tmp_path_factory.mktemp("catalog-results"), {"qwen": model})
    return {name: [json.loads(line) for line in (out / name / "metrics.jsonl").read_text().splitlines()]
            for name in ALGORITHMS}


@pytest.mark.parametrize("name", list(ALGORITHMS))
def test_each_algorithm_trains_two_steps(metrics, name):
    steps = [m for m in metrics[name] if "loss" in m]
    assert [m["step"] for m in steps] == [1, 2]
    for m in steps:
        assert m["step_skipped"] == 0.0 and math.isfinite(m["loss"]) and m["grad_norm"] > 0
        if OWN_METRIC[name]:
            assert math.isfinite(m[OWN_METRIC[name]])
    if name == "m2po":  # random behaviour log-probs: (log r)^2 far above 0.04, most of the trust region dropped
        assert all(m["m2po_m2_before"] > 0.04 >= m["m2po_m2_after"] and m["m2po_masked_frac"] > 0 for m in steps)
    if name in ("clip_b", "clip_v"):  # mu 0.5: some negative-advantage tokens dropped; clip_v within its 5% cap
        assert all(0 < m["entropy_clip_frac"] for m in steps)
        assert name == "clip_b" or all(m["entropy_clip_frac"] <= 0.05 for m in steps)
    if name == "jsd_distill":  # its own teacher: the student's and the teacher's log-probs agree at the first step
        assert steps[0]["teacher_kl"] == pytest.approx(0.0, abs=1e-5)
    if name == "remax":  # every group carries its greedy reward: none is dead-lettered
        assert all(not m.get("skipped") for m in steps)
    if name == "gigpo":  # the first group's failed sample left the step: 2 + 3 samples trained, the failure counted
        assert steps[0]["samples"] == 5 and steps[0]["failed_timeout"] == 1 and steps[1]["failed_timeout_total"] == 1
    if name == "raft":  # of each group [1, 0, -0.5] the best sample: a third of the samples, weighted 3
        assert all(m["raft_kept_frac"] == pytest.approx(1 / 3) for m in steps)
