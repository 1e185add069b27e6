"""M2PO, Clip_B and Clip_V, the algorithms that decide per token from the whole optimizer batch (`Needs.step_start`),
against their rules written independently in NumPy: M2PO's drop rule (sort the trust region's (log r)^2, keep the
longest prefix whose mean is <= the threshold) and its loss -A r over the kept tokens / all tokens, with its gradient;
Clip_B's and Clip_V's dropped tokens from given entropies and collision terms (Clip_V's cap on the share clipped
included), and GRPO's loss over what is left. The cutoffs are global: the step is split over two data-parallel
shards run in two threads whose `sum_over_replicas` is an in-memory all-reduce, and the masks must equal those of the
whole batch (a per-shard rule gives other masks on the same data).
"""
from __future__ import annotations

import math
import threading

import numpy as np
import pytest
import torch
from test_algorithms import ppo_reference, random_batch, torch_loss_and_grad

from rft.algorithms import build_algorithm
from rft.algorithms.config import AlgorithmConfig
from rft.algorithms.whole_batch import float32_of_bits, largest_true
from rft.config import ConfigError


def identity(t: torch.Tensor) -> torch.Tensor:
    return t


def as_micro_batch(batch: dict[str, np.ndarray], rows: np.ndarray) -> dict[str, torch.Tensor]:
    """Rows `rows` of `batch` as a micro-batch (the step-wide normalisers kept), `start_logprobs` = logp."""
    out = {k: torch.as_tensor(v[rows]) for k, v in batch.items()
           if k != "logp" and isinstance(v, np.ndarray) and v.ndim >= 1}
    out["start_logprobs"] = torch.as_tensor(batch["logp"][rows])
    for key in ("global_tokens", "global_sequences"):
        out[key] = torch.tensor(float(batch[key]))
    return out


def run_shards(prepare, shards: list[list[dict]]) -> list[list[dict]]:
    """`prepare(micro_batches, sum_over_replicas)` on each shard in its own thread, the sum an in-memory all-reduce."""
    barrier, slots = threading.Barrier(len(shards)), [None] * len(shards)
    results, errors = [None] * len(shards), []

    def worker(i):
        def sum_over_replicas(t):
            slots[i] = t.clone()
            barrier.wait()
            total = sum(slots)
            barrier.wait()
            return total
        try:
            results[i] = prepare(shards[i], sum_over_replicas)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)
            barrier.abort()
    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(shards))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results


def two_shards(batch, n_rows):
    """The rows dealt round-robin to two shards, each in micro-batches of 2 or 3 rows; and each row's place."""
    rows = np.arange(n_rows)
    shards = [rows[0::2], rows[1::2]]
    parts = [[s[:3], s[3:]] for s in shards]
    return [[as_micro_batch(batch, p) for p in shard] for shard in parts], [np.concatenate(s) for s in parts]


def gather(results, places, key, shape):
    out = np.zeros(shape, np.float32)
    for shard, rows in zip(results, places, strict=True):
        out[rows] = np.concatenate([mb[key].numpy() for mb in shard])
    return out


# --------------------------------------------------------------------------------------------------------- M2PO

def m2po_reference_mask(b, threshold, rows=None):
    """The paper's Algorithm 1 over `rows` (default: all): the kept tokens [rows, T] as a 0/1 array."""
    rows = np.arange(len(b["loss_mask"])) if rows is None else rows
    mask = b["loss_mask"][rows] > 0
    log_ratio = np.where(mask, b["logp"][rows] - b["old_logprobs"][rows], np.float32(0)).astype(np.float32)
    advantage = b["advantages"][rows][:, None]
    trust = mask & (((advantage > 0) & (log_ratio > 0)) | ((advantage < 0) & (log_ratio < 0)))
    squares = (log_ratio * log_ratio)[trust]
    keep = mask.copy()
    if len(squares) and squares.astype(np.float64).mean() > threshold:
        order = np.argsort(squares, kind="stable")
        kept = 0
        for n in range(1, len(order) + 1):  # the longest prefix (ascending) whose mean is <= the threshold
            if squares[order[:n]].astype(np.float64).mean() <= threshold:
                kept = n
        dropped = np.zeros(len(squares), bool)
        dropped[order[kept:]] = True
        where = np.argwhere(trust)
        for (i, t), drop in zip(where, dropped, strict=True):
            keep[i, t] = not drop
    return keep.astype(np.float32)


def test_m2po_drops_the_largest_squared_log_ratios_of_the_trust_region_until_the_mean_is_bounded():
    batch = random_batch(seed=3, rows=12, stale=0.6)
    algo = build_algorithm(AlgorithmConfig.of(name="m2po"))
    (out,) = run_shards(algo.prepare, [[as_micro_batch(batch, np.arange(12))]])
    expected = m2po_reference_mask(batch, 0.04)
    np.testing.assert_array_equal(out[0]["m2po_mask"].numpy(), expected)
    dropped = ((batch["loss_mask"] > 0) & (expected == 0)).sum()
    assert 0 < dropped < (batch["loss_mask"] > 0).sum()
    metrics = algo.step_metrics(1)
    assert metrics["m2po_m2_before"] > 0.04 >= metrics["m2po_m2_after"] > 0
    assert metrics["m2po_masked_frac"] == pytest.approx(dropped / batch["loss_mask"].sum())


def test_m2po_cutoff_is_global_over_data_parallel_shards():
    batch = random_batch(seed=5, rows=12, stale=0.6)
    algo = build_algorithm(AlgorithmConfig.of(name="m2po"))
    shards, places = two_shards(batch, 12)
    got = gather(run_shards(algo.prepare, shards), places, "m2po_mask", batch["loss_mask"].shape)
    whole = m2po_reference_mask(batch, 0.04)
    np.testing.assert_array_equal(got, whole)
    per_shard = np.zeros_like(whole)
    for rows in places:
        per_shard[rows] = m2po_reference_mask(batch, 0.04, rows)
    assert not np.array_equal(per_shard, whole), "the data must tell a global cutoff from per-shard ones"


def test_m2po_keeps_everything_under_the_threshold_and_nothing_of_the_region_when_each_token_exceeds_it():
    batch = random_batch(seed=7, rows=6, stale=0.001)
    algo = build_algorithm(AlgorithmConfig.of(name="m2po"))
    (out,) = run_shards(algo.prepare, [[as_micro_batch(batch, np.arange(6))]])
    np.testing.assert_array_equal(out[0]["m2po_mask"].numpy(), batch["loss_mask"])
    algo = build_algorithm(AlgorithmConfig.of(name="m2po", m2_threshold=0.0))  # every nonzero l^2 exceeds 0
    (out,) = run_shards(algo.prepare, [[as_micro_batch(batch, np.arange(6))]])
    np.testing.assert_array_equal(out[0]["m2po_mask"].numpy(), m2po_reference_mask(batch, 0.0))
    assert algo.step_metrics(1)["m2po_m2_after"] == 0.0


@pytest.mark.parametrize("clip", [20.0, 0.3])
def test_m2po_loss_is_minus_a_r_over_kept_tokens_divided_by_all_tokens(clip):
    batch = random_batch(seed=11, rows=12, stale=0.6)
    algo = build_algorithm(AlgorithmConfig.of(name="m2po", log_ratio_clip=clip))
    (out,) = run_shards(algo.prepare, [[as_micro_batch(batch, np.arange(12))]])
    keep = out[0]["m2po_mask"].numpy()
    n = float(batch["global_tokens"])
    loss, grad = 0.0, np.zeros(batch["logp"].shape)
    for i in range(12):
        for t in range(batch["logp"].shape[1]):
            if keep[i, t]:
                log_ratio = float(batch["logp"][i, t]) - float(batch["old_logprobs"][i, t])
                r = math.exp(min(max(log_ratio, -clip), clip))  # the value clamped, the gradient that of l
                loss += -float(batch["advantages"][i]) * r / n
                grad[i, t] = -float(batch["advantages"][i]) * r / n
    got_loss, got_grad, metrics = torch_loss_and_grad(algo, {**batch, "m2po_mask": keep})
    assert got_loss == pytest.approx(loss, rel=1e-5, abs=1e-7)
    np.testing.assert_allclose(got_grad, grad, rtol=1e-4, atol=1e-7)
    assert math.isfinite(metrics["m2po_ratio_mean"])


def test_m2po_refuses_the_off_policy_correction_and_seq_mean():
    for key, value in (("off_policy_correction", True), ("loss_agg", "seq_mean")):
        with pytest.raises(ConfigError, match=f"algorithm.{key}"):
            build_algorithm(AlgorithmConfig.of(name="m2po", **{key: value}))


def test_m2po_loss_names_a_missing_mask():
    batch = random_batch(seed=1)
    with pytest.raises(ValueError, match="m2po_mask"):
        torch_loss_and_grad(build_algorithm(AlgorithmConfig.of(name="m2po")), batch)


def test_bisection_finds_the_exact_float32_threshold():
    values = np.float32([0.1, 0.25, 0.3, 7.5])
    assert largest_true(lambda c: c < 0.3) == float(np.nextafter(np.float32(0.3), np.float32(0)))
    assert largest_true(lambda c: (values <= c).sum() <= 2) == float(np.nextafter(np.float32(0.3), np.float32(0)))
    assert largest_true(lambda c: False) == -math.inf and largest_true(lambda c: True) == math.inf
    assert float32_of_bits(0x3F800000) == 1.0


# ----------------------------------------------------------------------------------------------- Clip_B, Clip_V

def entropy_batch(seed: int, rows: int = 12):
    """A batch with the start's entropy and collision term at every position."""
    batch = random_batch(seed=seed, rows=rows, stale=0.2)
    rng = np.random.default_rng(seed + 100)
    batch["start_entropy"] = rng.uniform(0.1, 3.0, batch["logp"].shape).astype(np.float32)
    batch["start_collision"] = rng.normal(0, 1.0, batch["logp"].shape).astype(np.float32)
    return batch


def clip_reference(b, kind, mu, max_frac=None):
    """The tokens [rows, T] dropped by Clip_B / Clip_V (Trinity-RFT's advantage functions, written out)."""
    mask = b["loss_mask"] > 0
    logp = b["logp"].astype(np.float64)
    s = np.exp(logp) * (b["start_entropy"] + logp)
    x = s if kind == "clip_b" else b["start_collision"] - s
    values = x[mask]
    mean, std = values.mean(), values.std()  # population std
    negative = mask & (b["advantages"][:, None] < 0)
    if kind == "clip_b":
        return negative & (x - mean < -mu * std)
    candidates = negative & (x > mu * std)
    total = mask.sum()
    if candidates.sum() / total <= max_frac:
        return candidates
    limit = max(int(max_frac * total), 1)
    if candidates.sum() <= limit:
        return candidates
    order = sorted(map(tuple, np.argwhere(candidates)), key=lambda it: -x[it])
    dropped = np.zeros_like(candidates)
    for it in order[:limit]:
        dropped[it] = True
    return dropped


CLIP_CASES = [("clip_b", {}, 2.5, None), ("clip_b", {"entropy_clip_mu": 0.8}, 0.8, None),
              ("clip_v", {"entropy_clip_mu": 0.5, "entropy_clip_max_frac": 0.5}, 0.5, 0.5),
              ("clip_v", {"entropy_clip_mu": 0.5, "entropy_clip_max_frac": 0.06}, 0.5, 0.06)]


@pytest.mark.parametrize("name, options, mu, max_frac", CLIP_CASES)
def test_entropy_clipping_drops_the_reference_tokens_over_two_shards(name, options, mu, max_frac):
    batch = entropy_batch(seed=13)
    dropped = clip_reference(batch, name, mu, max_frac)
    assert dropped.any() or name == "clip_b" and mu == 2.5
    algo = build_algorithm(AlgorithmConfig.of(name=name, **options))
    assert algo.needs.step_start.entropy and algo.needs.step_start.collision == (name == "clip_v")
    shards, places = two_shards(batch, 12)
    results = run_shards(algo.prepare, shards)
    got = gather(results, places, "loss_mask", batch["loss_mask"].shape)
    np.testing.assert_array_equal(got, ((batch["loss_mask"] > 0) & ~dropped).astype(np.float32))
    kept = float(got.sum())
    assert all(float(mb["global_tokens"]) == kept for shard in results for mb in shard)
    metrics = algo.step_metrics(1)
    assert metrics["entropy_clip_frac"] == pytest.approx(dropped.sum() / batch["loss_mask"].sum())
    if name == "clip_v" and max_frac == 0.06:
        assert dropped.sum() == max(int(0.06 * batch["loss_mask"].sum()), 1) > 1, "the cap must act"


def test_clip_v_cap_keeps_the_largest_signals():
    batch = entropy_batch(seed=13)
    capped, uncapped = clip_reference(batch, "clip_v", 0.5, 0.06), clip_reference(batch, "clip_v", 0.5, 0.5)
    assert capped.sum() < uncapped.sum() and not (capped & ~uncapped).any()


@pytest.mark.parametrize("name", ["clip_b", "clip_v"])
def test_entropy_clipping_loss_is_grpo_over_the_kept_tokens(name):
    batch = entropy_batch(seed=17)
    algo = build_algorithm(AlgorithmConfig.of(name=name, entropy_clip_mu=0.5, **(
        {"entropy_clip_max_frac": 0.5} if name == "clip_v" else {})))
    (out,) = run_shards(algo.prepare, [[as_micro_batch(batch, np.arange(12))]])
    new = {**batch, "loss_mask": out[0]["loss_mask"].numpy(), "global_tokens": np.float32(out[0]["global_tokens"])}
    assert new["loss_mask"].sum() < batch["loss_mask"].sum()
    loss, grad, _ = torch_loss_and_grad(algo, new)
    ref_loss, ref_grad, _, _ = ppo_reference(new, clip_eps=0.2, agg="token_mean")
    assert loss == pytest.approx(ref_loss, rel=1e-5, abs=1e-7)
    np.testing.assert_allclose(grad, ref_grad, rtol=1e-4, atol=1e-7)


def test_a_constant_signal_drops_nothing():
    batch = entropy_batch(seed=19)
    batch["start_entropy"] = -batch["logp"].copy()  # S = p (H + log p) = 0 everywhere
    algo = build_algorithm(AlgorithmConfig.of(name="clip_b", entropy_clip_mu=0.01))
    (out,) = run_shards(algo.prepare, [[as_micro_batch(batch, np.arange(12))]])
    np.testing.assert_array_equal(out[0]["loss_mask"].numpy(), batch["loss_mask"])
