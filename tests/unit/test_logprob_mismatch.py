"""The training-inference mismatch metric (rft.algorithms.mismatch) against a NumPy reference over the whole step,
computed on the step split into micro-batches over data-parallel ranks and reduced as megatron_bridge.policy reduces
metrics (sum, max for `*_max`)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from rft.algorithms.mismatch import logprob_mismatch, with_mismatch_metrics


def reference(trainer: np.ndarray, rollout: np.ndarray, mask: np.ndarray) -> tuple[float, float]:
    """Mean and max of |trainer - rollout| over the selected tokens, by loops (0, 0 when none)."""
    gaps = [abs(float(trainer[i, t]) - float(rollout[i, t]))
            for i in range(mask.shape[0]) for t in range(mask.shape[1]) if mask[i, t] > 0]
    return (sum(gaps) / len(gaps), max(gaps)) if gaps else (0.0, 0.0)


def step(seed: int, rows: int = 11, length: int = 13):
    rng = np.random.default_rng(seed)
    mask = np.zeros((rows, length), np.float32)
    for i in range(rows - 2):  # the last two rows are padding
        start = rng.integers(1, 5)
        mask[i, start:rng.integers(start + 1, length + 1)] = 1.0
    trainer = -rng.exponential(1.0, (rows, length)).astype(np.float32)
    rollout = (trainer + rng.normal(0, 0.2, trainer.shape)).astype(np.float32)
    rollout[mask == 0] = np.float32(-1e30)  # what padding holds must not matter
    demo = np.zeros(rows, np.float32)
    demo[0] = 1.0  # a demonstration row: its recorded log-probs are not an engine's
    return trainer, rollout, mask, demo


@pytest.mark.parametrize("dp,micro", [(1, 11), (1, 3), (2, 2), (3, 1)])
def test_split_over_micro_batches_and_ranks_equals_the_reference(dp, micro):
    trainer, rollout, mask, demo = step(seed=dp * 10 + micro)
    kept = mask * (demo[:, None] == 0)
    want_mean, want_max = reference(trainer, rollout, kept)
    wrapped = with_mismatch_metrics(lambda logp, mb: (logp.sum() * 0, {}))
    totals = []
    for rank in range(dp):
        rows = list(range(rank, len(mask), dp))
        per_micro = []
        for start in range(0, len(rows), micro):
            take = rows[start:start + micro]
            mb = {"loss_mask": torch.tensor(mask[take]), "old_logprobs": torch.tensor(rollout[take]),
                  "demo_mask": torch.tensor(demo[take]), "global_tokens": torch.tensor(float(mask.sum())),
                  "global_demo_tokens": torch.tensor(float((mask * demo[:, None]).sum()))}
            per_micro.append(wrapped(torch.tensor(trainer[take]), mb)[1])
        totals.append({"mean": sum(m["logprob_mismatch_mean"] for m in per_micro),
                       "max": max(m["logprob_mismatch_max"] for m in per_micro)})
    assert float(sum(t["mean"] for t in totals)) == pytest.approx(want_mean, rel=1e-6)
    assert float(max(t["max"] for t in totals)) == pytest.approx(want_max, rel=1e-6)
    assert want_max > 0


def test_no_selected_token_gives_zero_and_a_prefix_names_a_subset():
    trainer, rollout, mask, _ = step(seed=3)
    out = logprob_mismatch(torch.tensor(trainer), torch.tensor(rollout), torch.zeros(mask.shape), normaliser=0)
    assert float(out["logprob_mismatch_mean"]) == 0.0 and float(out["logprob_mismatch_max"]) == 0.0
    first = np.zeros_like(mask)
    first[:3] = mask[:3]
    out = logprob_mismatch(torch.tensor(trainer), torch.tensor(rollout), torch.tensor(first),
                           normaliser=float(first.sum()), prefix="logprob_mismatch_stale1")
    assert sorted(out) == ["logprob_mismatch_stale1_max", "logprob_mismatch_stale1_mean"]
    assert float(out["logprob_mismatch_stale1_mean"]) == pytest.approx(reference(trainer, rollout, first)[0])


def test_shapes_must_agree():
    with pytest.raises(ValueError, match="one \\[b, T\\] shape"):
        logprob_mismatch(torch.zeros(2, 3), torch.zeros(2, 4), torch.ones(2, 3), normaliser=6)
