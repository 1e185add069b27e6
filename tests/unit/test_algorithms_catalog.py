"""The REINFORCE-family catalog (sapo, topr, sppo, opmd, asymre, rec, reinforce, raft) against its formulas written
independently in NumPy: loops over samples and tokens give each token's loss and its derivative in logp, reduced by
token_mean / seq_mean by hand; the advantages are the group formulas in plain Python. Also: padding and masked tokens
hold garbage that must never reach the loss, the band edges of the clip modes, and invariance under micro-batch and
data-parallel splits (the batch contract).
"""
from __future__ import annotations

import math

import numpy as np
import pytest
from test_algorithms import assert_split_changes_nothing, random_batch, torch_loss_and_grad

from rft.algorithms import build_algorithm
from rft.algorithms.config import AlgorithmConfig
from rft.config import ConfigError


def garbage_padding(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """`batch` with huge values at every position outside the loss mask: a loss that reads them is wrong or inf."""
    out = dict(batch)
    outside = batch["loss_mask"] == 0
    for key in ("old_logprobs", "ref_logprobs"):
        out[key] = np.where(outside, np.float32(-300.0), batch[key]).astype(np.float32)
    return out


def reduce(batch, per_token_fn, agg):
    """(loss, d loss / d logp) for the per-token (value, derivative) of `per_token_fn(i, t)`, reduced by `agg`."""
    mask = batch["loss_mask"]
    n_tokens, n_seqs = float(batch["global_tokens"]), float(batch["global_sequences"])
    loss, grad = 0.0, np.zeros(mask.shape)
    for i in range(mask.shape[0]):
        length = mask[i].sum()
        for t in range(mask.shape[1]):
            if mask[i, t]:
                scale = 1.0 / n_tokens if agg == "token_mean" else 1.0 / (length * n_seqs)
                value, derivative = per_token_fn(i, t)
                loss += scale * value
                grad[i, t] = scale * derivative
    return loss, grad


def check(name, batch, per_token_fn, *, agg="token_mean", **options):
    algo = build_algorithm(AlgorithmConfig.of(name=name, loss_agg=agg, **options))
    loss, grad, metrics = torch_loss_and_grad(algo, garbage_padding(batch))
    ref_loss, ref_grad = reduce(batch, per_token_fn, agg)
    assert math.isfinite(loss)
    assert loss == pytest.approx(ref_loss, rel=1e-5, abs=1e-6)
    np.testing.assert_allclose(grad, ref_grad, rtol=1e-4, atol=1e-6)
    return metrics


def parts(batch, i, t):
    """(logp, behaviour log-prob, ratio, A) of token t of row i, in float64."""
    logp, old = float(batch["logp"][i, t]), float(batch["old_logprobs"][i, t])
    return logp, old, math.exp(logp - old), float(batch["advantages"][i])


def sigmoid(x):
    return 1.0 / (1.0 + math.exp(-x))


# ----------------------------------------------------------------------------------------------------------- losses

@pytest.mark.parametrize("agg", ["token_mean", "seq_mean"])
def test_sapo_is_a_detached_sigmoid_gate_on_logp(agg):
    batch = random_batch(seed=21, stale=0.6)

    def token(i, t):
        logp, _, r, a = parts(batch, i, t)
        tau = 1.0 if a > 0 else 1.05
        gate = 4 / tau * sigmoid(tau * (r - 1))
        return -a * gate * logp, -a * gate
    metrics = check("sapo", batch, token, agg=agg)
    assert 0 < metrics["sapo_gate_mean"] < 4


def test_sapo_gate_is_two_over_tau_on_policy_and_its_temperatures_are_checked():
    batch = random_batch(seed=22)
    batch["old_logprobs"] = batch["logp"] * batch["loss_mask"]  # r = 1: gate 4 / tau * 1/2
    check("sapo", batch, lambda i, t: (lambda a, lp: (-a * (2 / (2.0 if a > 0 else 3.0)) * lp,
                                                      -a * (2 / (2.0 if a > 0 else 3.0))))(
        parts(batch, i, t)[3], parts(batch, i, t)[0]), sapo_tau_pos=2.0, sapo_tau_neg=3.0)
    with pytest.raises(ConfigError, match=r"algorithm.sapo_tau_neg: must be >= sapo_tau_pos \(2.0\), got 1.5"):
        build_algorithm(AlgorithmConfig.of(name="sapo", sapo_tau_pos=2.0, sapo_tau_neg=1.5))


@pytest.mark.parametrize("threshold", [0.0, 0.5])
def test_topr_tapers_only_samples_at_or_below_the_threshold(threshold):
    batch = random_batch(seed=23, stale=0.5)
    batch["advantages"][0] = threshold  # exactly at the threshold: a negative

    def token(i, t):
        logp, _, r, reward = parts(batch, i, t)
        alpha = min(max(r, 0.0), 1.0) if reward <= threshold else 1.0
        return -alpha * reward * logp, -alpha * reward
    metrics = check("topr", batch, token, topr_threshold=threshold)
    assert 0 < metrics["topr_negative_frac"] < 1 and metrics["topr_alpha_mean"] < 1


@pytest.mark.parametrize("agg", ["token_mean", "seq_mean"])
def test_sppo_drops_tokens_outside_its_band_and_keeps_the_edges(agg):
    batch = random_batch(seed=24, stale=0.4)
    # row 0's first tokens sit just inside and just outside both edges of [1 / 1.3, 1.3]
    row0 = np.flatnonzero(batch["loss_mask"][0])
    edges = [math.log(1.3) - 1e-4, math.log(1.3) + 1e-4, -math.log(1.3) + 1e-4, -math.log(1.3) - 1e-4]
    for t, gap in zip(row0, edges, strict=False):
        batch["old_logprobs"][0, t] = batch["logp"][0, t] - np.float32(gap)

    def token(i, t):
        logp, old, r, a = parts(batch, i, t)
        inside = 1 / 1.3 <= r <= 1.3
        return (-a * (logp - old), -a) if inside else (0.0, 0.0)
    metrics = check("sppo", batch, token, agg=agg)
    assert 0.05 < metrics["clip_frac"] < 0.95


def test_opmd_and_asymre_scale_the_policy_gradient_by_one_over_one_plus_tau():
    batch = random_batch(seed=25, stale=2.0)  # far from the behaviour policy: no ratio enters
    for name, options in (("opmd", dict(opmd_tau=1.0)), ("opmd", dict(opmd_tau=0.25)),
                          ("asymre", dict(opmd_tau=3.0))):
        tau = options["opmd_tau"]
        check(name, batch, lambda i, t, tau=tau: (-parts(batch, i, t)[3] * parts(batch, i, t)[0] / (1 + tau),
                                                  -parts(batch, i, t)[3] / (1 + tau)), **options)


def test_reinforce_is_grpo_loss_with_the_raw_reward():
    batch = random_batch(seed=26, stale=0.05)  # on-policy enough that nothing is clipped

    def token(i, t):
        _, _, r, a = parts(batch, i, t)
        assert 0.8 < r < 1.2
        return -r * a, -r * a
    check("reinforce", batch, token)


REC_CASES = [
    dict(rec_clip_mode="none", rec_weight="none"),
    dict(rec_clip_mode="one_side", rec_weight="none"),
    dict(rec_clip_mode="one_side", rec_weight="token_is"),
    dict(rec_clip_mode="two_side", rec_weight="token_is", clip_eps_low=0.1, clip_eps_high=0.28),
    dict(rec_clip_mode="ring", rec_weight="none", rec_eps_low_prime=0.3, rec_eps_high_prime=0.5),
    dict(rec_clip_mode="two_side", rec_weight="sequence_is"),
    dict(rec_clip_mode="none", rec_weight="advantage", rec_temp=0.5),
    dict(rec_clip_mode="one_side", rec_regularizer="forward_kl", rec_regularizer_coef=0.3),
    dict(rec_clip_mode="two_side", rec_regularizer="k2", rec_regularizer_coef=0.3, loss_agg="seq_mean"),
]


@pytest.mark.parametrize("options", REC_CASES, ids=lambda o: "-".join(str(v) for v in o.values()))
def test_rec_clip_modes_weights_and_regularisers_match_the_formula(options):
    options = dict(options)
    agg = options.pop("loss_agg", "token_mean")
    batch = random_batch(seed=27, stale=0.5)
    lo, hi = 1 - options.get("clip_eps_low", 0.2), 1 + options.get("clip_eps_high", 0.2)
    mode, weight = options["rec_clip_mode"], options.get("rec_weight", "none")
    mask = batch["loss_mask"]

    def token(i, t):
        logp, old, r, a = parts(batch, i, t)
        keep = {"none": True, "two_side": lo <= r <= hi,
                "one_side": (a >= 0 and r <= hi) or (a <= 0 and r >= lo),
                "ring": lo <= r <= hi or (a >= 0 and r <= 1 - options.get("rec_eps_low_prime", 0))
                or (a <= 0 and r >= 1 + options.get("rec_eps_high_prime", 0))}[mode]
        tokens = [u for u in range(mask.shape[1]) if mask[i, u]]
        seq_ratio = math.exp(sum(float(batch["logp"][i, u]) - float(batch["old_logprobs"][i, u]) for u in tokens)
                             / len(tokens))
        a_w = {"none": a, "token_is": a * r, "sequence_is": a * seq_ratio,
               "advantage": a * math.exp(a / options.get("rec_temp", 1.0))}[weight]
        value, derivative = (-a_w * logp, -a_w) if keep else (0.0, 0.0)
        coef = options.get("rec_regularizer_coef", 0.0)
        if options.get("rec_regularizer") == "forward_kl":
            value, derivative = value - coef * logp, derivative - coef
        elif options.get("rec_regularizer") == "k2":
            value, derivative = value + coef * (logp - old) ** 2, derivative + 2 * coef * (logp - old)
        return value, derivative
    metrics = check("rec", batch, token, agg=agg, **options)
    assert (metrics["clip_frac"] > 0) == (mode != "none")


@pytest.mark.parametrize("agg", ["token_mean", "seq_mean"])
def test_raft_is_nll_of_the_kept_samples_rescaled_by_their_share(agg):
    batch = random_batch(seed=28)
    batch["advantages"] = np.array([3.0, 0.0, 3.0, 1.5, 0.0, 0.0, 0.0], np.float32)  # weights B / K (K = 2 + 1)
    metrics = check("raft", batch, lambda i, t: (-batch["advantages"][i] * batch["logp"][i, t],
                                                 -batch["advantages"][i]), agg=agg)
    assert metrics["raft_kept_frac"] == pytest.approx(3 / 6)


# ------------------------------------------------------------------------------------------------------- advantages

def advantages(name, groups, **options):
    algo = build_algorithm(AlgorithmConfig.of(name=name, **options))
    return [a.tolist() for a in algo.advantages([np.array(g, dtype=np.float64) for g in groups])]


GROUPS = [[1.0, 0.0, 0.0, 1.0], [0.2, 0.9, 0.4], [5.0], [0.0, 0.0]]


def test_reinforce_and_topr_advantages_are_the_rewards():
    for name in ("reinforce", "topr"):
        assert sum(advantages(name, GROUPS), []) == pytest.approx(sum(GROUPS, []))


def test_group_mean_baselines_of_opmd_asymre_sppo_and_rec():
    def mean_centred(g, shift=0.0, single=0.0):
        if len(g) == 1:
            return [single]
        m = sum(g) / len(g)
        return [r - m - shift for r in g]
    for name in ("opmd", "sppo", "rec"):
        expected = [mean_centred(g, single=g[0] if name == "opmd" else 0.0) for g in GROUPS]
        assert np.allclose(sum(advantages(name, GROUPS), []), sum(expected, []), atol=1e-6), name
    expected = [mean_centred(g, shift=-0.1, single=g[0]) for g in GROUPS]
    assert np.allclose(sum(advantages("asymre", GROUPS), []), sum(expected, []), atol=1e-6)
    expected = [mean_centred(g, shift=0.25, single=g[0]) for g in GROUPS]
    assert np.allclose(sum(advantages("asymre", GROUPS, asymre_shift=0.25), []), sum(expected, []), atol=1e-6)


@pytest.mark.parametrize("tau", [0.1, 1.0, 50.0])
def test_opmd_logavgexp_baseline(tau):
    groups = [[1.0, 0.0, 0.0, 1.0], [200.0, 0.0, 150.0]]  # the second would overflow exp(r / tau) unshifted
    got = advantages("opmd", groups, opmd_baseline="logavgexp", opmd_tau=tau)
    for g, a in zip(groups, got, strict=True):
        top = max(g)
        baseline = top + tau * math.log(sum(math.exp((r - top) / tau) for r in g) / len(g))
        assert a == pytest.approx([r - baseline for r in g], abs=1e-4)
    assert min(got[0]) < 0 < max(got[0])


def test_rec_std_normalize_divides_by_the_group_std():
    got = advantages("rec", [[0.2, 0.9, 0.4]], std_normalize=True)[0]
    g = [0.2, 0.9, 0.4]
    m = sum(g) / 3
    std = math.sqrt(sum((r - m) ** 2 for r in g) / 2)
    assert got == pytest.approx([(r - m) / (std + 1e-6) for r in g], rel=1e-5)


@pytest.mark.parametrize("best_only, threshold, kept", [
    (True, 0.0, [[1, 0, 0, 1], [0, 1, 0], [1], [0, 0]]),
    (False, 0.3, [[1, 0, 0, 1], [0, 1, 1], [1], [0, 0]]),
    (True, 5.0, [[0, 0, 0, 0], [0, 0, 0], [0], [0, 0]]),
])
def test_raft_keeps_the_best_samples_above_the_threshold(best_only, threshold, kept):
    got = advantages("raft", GROUPS, raft_best_only=best_only, raft_threshold=threshold)
    total, count = sum(len(g) for g in GROUPS), sum(sum(k) for k in kept)
    assert got == [[k * (total / count if count else 0.0) for k in ks] for ks in kept]


# ----------------------------------------------------------------------------------------------- splits and shapes

SPLIT_CASES = [
    ("sapo", dict(kl_coef=0.1)), ("sapo", dict(loss_agg="seq_mean", off_policy_correction=True)),
    ("topr", dict(topr_threshold=0.3)), ("sppo", dict(loss_agg="seq_mean")), ("opmd", dict(kl_coef=0.1)),
    ("asymre", dict()), ("reinforce", dict()), ("raft", dict(loss_agg="seq_mean")),
    ("rec", dict(rec_clip_mode="ring", rec_weight="sequence_is", rec_regularizer="k2", rec_regularizer_coef=0.1)),
]


@pytest.mark.parametrize("name, options", SPLIT_CASES)
def test_splitting_into_micro_batches_and_shards_changes_nothing(name, options):
    assert_split_changes_nothing(build_algorithm(AlgorithmConfig.of(name=name, **options)),
                                 garbage_padding(random_batch(seed=29, rows=12, stale=0.5)))


@pytest.mark.parametrize("name", ["sapo", "topr", "sppo", "opmd", "asymre", "rec", "reinforce", "raft"])
def test_a_missing_key_is_named(name):
    batch = random_batch(seed=30)
    del batch["advantages"]
    with pytest.raises(ValueError, match=rf"{name} loss: micro-batch lacks advantages"):
        torch_loss_and_grad(build_algorithm(AlgorithmConfig.of(name=name)), batch)
