"""The run's reward.png: mean reward by step and by time, with each eval set's held-out accuracy beside it."""
from __future__ import annotations

import json

import pytest

from rft.observability.plots import _eval_accuracies, plot_rewards


def test_the_plot_draws_rewards_and_each_eval_sets_accuracy(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    records = [{"time": 100.0, "step": 0, "eval/arith/accuracy": 0.14, "eval/gsm/accuracy": 0.05},
               *({"time": 100.0 + 10 * s, "step": s, "reward_mean": 0.1 * s} for s in range(1, 5)),
               {"time": 150.0, "step": 4, "eval/arith/accuracy": 0.3}]
    metrics.write_text("".join(json.dumps(r) + "\n" for r in records))
    assert {name: [r["step"] for r in rs] for name, rs in _eval_accuracies(records).items()} == \
        {"arith": [0, 4], "gsm": [0]}
    png = plot_rewards(metrics, tmp_path / "reward.png", title="t")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    metrics.write_text(json.dumps(records[0]) + "\n")
    with pytest.raises(ValueError, match="no step has a reward_mean"):
        plot_rewards(metrics, tmp_path / "none.png")
