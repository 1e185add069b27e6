"""The training-inference mismatch metrics (rft.algorithms.mismatch) against a NumPy reference over the whole step:
mean and max |trainer - rollout|, the k3 KL estimate and the share of tokens past the ratio, overall and split by
each token's staleness (records whose samples' tokens come from several versions, rft.schema `version_spans`),
computed on the step built by rft/trainer/batch.py, split into micro-batches over data-parallel ranks and reduced as
megatron_bridge.policy reduces metrics (sum, max for `*_max`)."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from rft.algorithms.mismatch import logprob_mismatch, with_mismatch_metrics
from rft.trainer.batch import plan_micro_batches, rows_from_groups
from tests.records import make_group

TRAINED = 5  # the step trains version 5 -> 6: a token of version v has staleness 5 - v


def step_groups(seed: int):
    """Groups of versions 5, 4, 3 and 0, one sample of the version-4 group mixing 4, 5 (in-flight updates), one of
    the version-0 group with two tokens that leave the loss; a demonstration group."""
    rng = np.random.default_rng(seed)
    groups = [make_group("run", i, policy_version=v, n_samples=3, response_len=int(rng.integers(3, 8)), seed=seed + i)
              for i, v in enumerate([5, 4, 3, 0])]
    mixed = groups[1].samples[0]
    mixed.token_versions = np.array([4] * 2 + [5] * (len(mixed.response_tokens) - 2))
    groups[3].samples[1].loss_mask[:2] = 0
    demo = make_group("demo", 9, n_samples=1, seed=seed + 9)
    return groups, demo


def reference(groups, trainer: dict, ratio: float) -> dict[str, float]:
    """The module docstring's values by loops: per (group, sample, token) in the loss, x = trainer - rollout."""
    by_bucket: dict[str, list[float]] = {}
    everything: list[float] = []
    for g in groups:
        for s in g.samples:
            versions = s.versions_of(g.policy_version)
            for t in range(len(s.response_tokens)):
                if not s.loss_mask[t]:
                    continue
                x = float(trainer[(g.group_id, s.sample_index)][t]) - float(s.logprobs[t])
                everything.append(x)
                staleness = TRAINED - int(versions[t])
                name = f"stale{staleness}" if staleness < 4 else "stale4plus"
                by_bucket.setdefault(name, []).append(x)
    out = {}
    for name, xs in [("", everything), *by_bucket.items()]:
        prefix = "logprob_mismatch" + (f"_{name}" if name else "")
        out[f"{prefix}_mean"] = sum(abs(x) for x in xs) / len(xs)
        out[f"{prefix}_max"] = max(abs(x) for x in xs)
        out[f"{prefix}_kl"] = sum(math.exp(x) - x - 1 for x in xs) / len(xs)
        out[f"{prefix}_frac"] = sum(abs(x) > math.log(ratio) for x in xs) / len(xs)
    return out


@pytest.mark.parametrize("dp,micro", [(1, 16), (1, 3), (2, 2), (3, 1)])
def test_split_over_micro_batches_and_ranks_equals_the_reference(dp, micro):
    groups, demo = step_groups(seed=dp * 10 + micro)
    rng = np.random.default_rng(micro)
    trainer = {(g.group_id, s.sample_index): s.logprobs + rng.normal(0, 0.5, len(s.logprobs)).astype(np.float32)
               for g in groups + [demo] for s in g.samples}
    rows = rows_from_groups(groups, [np.zeros(len(g.samples)) for g in groups])
    demo_rows = rows_from_groups([demo], [np.zeros(1)])
    for row in demo_rows:
        row.demo = True
    keys = [(g.group_id, s.sample_index) for g in groups + [demo] for s in g.samples]
    by_row = {id(row): trainer[key] for row, key in zip(rows + demo_rows, keys, strict=True)}
    plan = plan_micro_batches(rows + demo_rows, dp_size=dp, micro_batch_size=micro, trained_version=TRAINED)
    wrapped = with_mismatch_metrics(lambda logp, mb: (logp.sum() * 0, {}), ratio=1.5)
    per_micro = []
    for rank in range(dp):
        for (planned, _, _), mb in zip(plan.ranks[rank], plan.for_rank(rank), strict=True):
            logp = torch.full(mb["loss_mask"].shape, -1e30)  # what padding holds must not matter
            for i, row in enumerate(planned):
                start = row.prompt_len - 1
                logp[i, start:start + len(row.loss_mask)] = torch.from_numpy(by_row[id(row)])
            per_micro.append(wrapped(logp, mb)[1])
    names = set(per_micro[0])
    assert all(set(m) == names for m in per_micro), "every micro-batch of the step emits the same names"
    got = {k: float(max(m[k] for m in per_micro)) if k.endswith("_max") else float(sum(m[k] for m in per_micro))
           for k in names}
    want = reference(groups, trainer, ratio=1.5)
    assert sorted(got) == sorted(want)
    assert {k.split("_")[2] for k in want if k.count("_") == 3} == {"stale0", "stale1", "stale2", "stale4plus"}
    for key, value in want.items():
        assert got[key] == pytest.approx(value, rel=1e-6), key
    assert 0 < want["logprob_mismatch_frac"] < 1


def test_the_staleness_buckets_follow_each_tokens_version():
    groups, _ = step_groups(seed=3)
    rows = rows_from_groups(groups, [np.zeros(len(g.samples)) for g in groups])
    plan = plan_micro_batches(rows, dp_size=1, micro_batch_size=16, trained_version=TRAINED)
    (mb,) = plan.for_rank(0)
    mixed = rows[3]  # group 1 (version 4), sample 0: tokens of versions 4 then 5
    start = mixed.prompt_len - 1
    assert mb["staleness_bucket"][3, start:start + len(mixed.loss_mask)].tolist() == [1, 1] + [0] * (
        len(mixed.loss_mask) - 2)
    assert mb["staleness_bucket"][3, :start].tolist() == [-1] * start  # the prompt
    zero = rows[10]  # group 3 (version 0), sample 1: its first two tokens leave the loss
    start = zero.prompt_len - 1
    assert mb["staleness_bucket"][10, start:start + 3].tolist() == [-1, -1, 4]
    assert mb["staleness_tokens"].tolist() == [
        float(sum(len(s.response_tokens) for s in groups[0].samples) + len(mixed.loss_mask) - 2), 2.0 +
        sum(len(s.response_tokens) for s in groups[1].samples[1:]),
        float(sum(len(s.response_tokens) for s in groups[2].samples)), 0.0,
        float(sum(s.loss_mask.sum() for s in groups[3].samples))]
    assert "staleness_bucket" not in plan_micro_batches(rows, dp_size=1, micro_batch_size=16).for_rank(0)[0]


def test_no_selected_token_gives_zero_and_a_prefix_names_a_subset():
    rng = np.random.default_rng(3)
    trainer = torch.tensor(-rng.exponential(1.0, (4, 6)))
    rollout = trainer + torch.tensor(rng.normal(0, 0.3, (4, 6)))
    out = logprob_mismatch(trainer, rollout, torch.zeros(4, 6), normaliser=0)
    assert {k: float(v) for k, v in out.items()} == {"logprob_mismatch_mean": 0.0, "logprob_mismatch_max": 0.0,
                                                     "logprob_mismatch_kl": 0.0, "logprob_mismatch_frac": 0.0}
    out = logprob_mismatch(trainer, rollout, torch.ones(4, 6), normaliser=24, prefix="logprob_mismatch_stale1")
    assert sorted(out) == ["logprob_mismatch_stale1_frac", "logprob_mismatch_stale1_kl", "logprob_mismatch_stale1_max",
                           "logprob_mismatch_stale1_mean"]


def test_shapes_and_the_ratio_must_fit():
    with pytest.raises(ValueError, match="one \\[b, T\\] shape"):
        logprob_mismatch(torch.zeros(2, 3), torch.zeros(2, 4), torch.ones(2, 3), normaliser=6)
    with pytest.raises(ValueError, match="trainer.mismatch_ratio: must be > 1"):
        with_mismatch_metrics(lambda logp, mb: (logp, {}), ratio=1.0)
