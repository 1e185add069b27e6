"""`rft bench micro-batches` on the tiny model: one record per micro-batching setting, trained on the same rows
(their losses agree), shared prompts among them (rows in groups of 8 sharing a prompt), and with `--transformers`
the reference row: the same rows trained by transformers' model."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.distributed
REPO = Path(__file__).resolve().parents[2]
STEPS = 3


def test_micro_batch_settings_and_the_transformers_reference(tiny_model):
    result = subprocess.run(
        [sys.executable, "-m", "rft.cli", "bench", "micro-batches", str(tiny_model), "--rows", "16", "--steps",
         str(STEPS), "--prompt-len", "4:12", "--response-len", "2:10", "--budgets", "48", "--group-size", "8",
         "--share-prompts", "--transformers", "--json"],
        cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    records = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    padded, budget, shared, reference = records
    assert (padded["max_tokens_per_micro_batch"], budget["max_tokens_per_micro_batch"]) == (0, 48)
    assert (padded["share_prompts"], shared["share_prompts"], shared["group_size"]) == (False, True, 8)
    assert shared["loss"] == pytest.approx(padded["loss"], rel=1e-5)  # the same rows, their prompts run once
    assert padded["padding_fraction"] > budget["padding_fraction"] >= 0  # the budget packs rows of like lengths
    assert padded["loss"] == pytest.approx(budget["loss"], rel=1e-5) and len(padded["loss"]) == STEPS
    assert all(r["train_s"] > 0 for r in records)
    assert reference["reference"] == "transformers" and reference["micro_batch_size"] == 8
