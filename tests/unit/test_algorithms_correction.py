"""The off-policy corrections (rft/algorithms/correction.py): token-level truncated (TIS) and masked (MIS) importance
sampling and IcePop-style sequence masking on the geometric-mean ratio, inside the decoupled PPO objective, against
textbook formulas written independently in NumPy (loops over samples and tokens), in value and gradient, through the
algorithms that share them (grpo, gspo, cispo), and for invariance under micro-batch and data-parallel splits. The
batches and split helpers are test_algorithms.py's."""
from __future__ import annotations

import math

import numpy as np
import pytest
from test_algorithms import assert_split_changes_nothing, random_batch, torch_loss_and_grad

from rft.algorithms import build_algorithm
from rft.algorithms.config import AlgorithmConfig
from rft.config import ConfigError


def drifted_batch(seed: int, *, rows: int = 12, length: int = 9) -> dict[str, np.ndarray]:
    """Behaviour log-probs that drifted per sample (a version shift, some samples far, some close) plus token noise,
    and an explicit proximal policy near the current one, so that every rule has tokens and samples on both sides of
    its bounds."""
    batch = random_batch(seed, rows=rows, length=length, stale=0.0)
    rng = np.random.default_rng(seed + 7)
    shift = rng.choice([-1.2, -0.3, -0.02, 0.0, 0.02, 0.3, 1.2], size=(rows, 1))
    noise = rng.normal(0, 0.6, batch["logp"].shape)
    batch["old_logprobs"] = ((batch["logp"] + shift + noise) * batch["loss_mask"]).astype(np.float32)
    batch["prox_logprobs"] = (batch["logp"] + rng.normal(0, 0.05, batch["logp"].shape)).astype(np.float32)
    return batch


def weights_reference(b, *, rule: str, cap: float, floor: float, mask_h: float | None, level: str = "token"):
    """w[i][t] by the textbook rules: rho = pi_prox / pi_behav per token (or the sample's geometric mean at the
    sequence level); tis min(rho, cap); mis rho inside [floor, cap] else 0; a sample whose geometric-mean rho is
    outside [1/H, H] gets 0 everywhere. Also the counts (truncated tokens, masked tokens, masked samples)."""
    prox, behav, mask = b["prox_logprobs"].astype(np.float64), b["old_logprobs"].astype(np.float64), b["loss_mask"]
    w = np.zeros_like(prox)
    truncated = masked = masked_samples = 0
    for i in range(prox.shape[0]):
        tokens = [t for t in range(prox.shape[1]) if mask[i, t]]
        if not tokens:
            continue
        geo = math.exp(sum(prox[i, t] - behav[i, t] for t in tokens) / len(tokens))
        keep_sample = mask_h is None or 1 / mask_h <= geo <= mask_h
        masked_samples += not keep_sample
        for t in tokens:
            rho = geo if level == "sequence" else math.exp(prox[i, t] - behav[i, t])
            if rule == "tis":
                value = min(rho, cap)
                truncated += rho >= cap
            else:
                value = rho if floor <= rho <= cap else 0.0
            w[i, t] = value if keep_sample else 0.0
            masked += w[i, t] == 0
    return w, truncated, masked, masked_samples


def decoupled_reference(b, w, *, eps_low: float, eps_high: float, agg: str = "token_mean"):
    """The decoupled PPO objective per token, -w * min(r A, clip(r) A) with r = exp(logp - prox), and d/d logp."""
    logp, prox, mask = b["logp"].astype(np.float64), b["prox_logprobs"].astype(np.float64), b["loss_mask"]
    n_tokens, n_seqs = float(b["global_tokens"]), float(b["global_sequences"])
    loss, grad = 0.0, np.zeros_like(logp)
    for i in range(logp.shape[0]):
        length = mask[i].sum()
        for t in range(logp.shape[1]):
            if not mask[i, t]:
                continue
            scale = 1.0 / n_tokens if agg == "token_mean" else 1.0 / (length * n_seqs)
            A = float(b["advantages"][i])
            r = math.exp(logp[i, t] - prox[i, t])
            r_clip = min(max(r, 1 - eps_low), 1 + eps_high)
            if r * A <= r_clip * A:
                loss += scale * -w[i, t] * r * A
                grad[i, t] = scale * -w[i, t] * r * A
            else:
                loss += scale * -w[i, t] * r_clip * A
    return loss, grad


CASES = [  # (importance_sampling, importance_floor, importance_cap, sequence_mask)
    ("tis", 0.5, 2.0, None),
    ("mis", 0.5, 2.0, None),  # IcePop's token band [0.5, 2]
    ("mis", 0.8, 1.25, None),
    ("tis", 0.5, 2.0, 1.3),  # Geo-RS-Token-TIS
    ("mis", 0.5, 5.0, 1.3),
]


@pytest.mark.parametrize("rule, floor, cap, mask_h", CASES)
@pytest.mark.parametrize("agg", ["token_mean", "seq_mean"])
def test_grpo_corrections_match_textbook(rule, floor, cap, mask_h, agg):
    batch = drifted_batch(seed=31)
    algo = build_algorithm(AlgorithmConfig.of(name="grpo", off_policy_correction=True, importance_sampling=rule,
                                              importance_floor=floor, importance_cap=cap, sequence_mask=mask_h,
                                              loss_agg=agg))
    w, truncated, masked, masked_samples = weights_reference(batch, rule=rule, cap=cap, floor=floor, mask_h=mask_h)
    tokens, sequences = float(batch["global_tokens"]), float(batch["global_sequences"])
    kept = w[batch["loss_mask"] > 0]
    bitten = truncated if rule == "tis" else kept.size - np.count_nonzero(kept)  # tis caps, mis zeroes
    assert 0 < bitten < kept.size, f"the rule must bite on some tokens, not all ({bitten} of {kept.size})"
    if mask_h is not None:
        assert 0 < masked_samples < sequences, "some samples masked, some kept"
    loss, grad, metrics = torch_loss_and_grad(algo, batch)
    ref_loss, ref_grad = decoupled_reference(batch, w, eps_low=0.2, eps_high=0.2, agg=agg)
    assert loss == pytest.approx(ref_loss, rel=1e-5, abs=1e-7)
    np.testing.assert_allclose(grad, ref_grad, rtol=1e-4, atol=1e-7)
    assert metrics["importance_weight_mean"] == pytest.approx(kept.sum() / tokens, rel=1e-5)
    if rule == "tis":
        assert metrics["importance_weight_truncated_frac"] == pytest.approx(truncated / tokens, rel=1e-5)
        assert truncated > 0
    if rule == "mis" or mask_h is not None:
        assert metrics["importance_masked_frac"] == pytest.approx(masked / tokens, rel=1e-5)
    assert ("sequence_masked_frac" in metrics) == (mask_h is not None)
    if mask_h is not None:
        assert metrics["sequence_masked_frac"] == pytest.approx(masked_samples / sequences, rel=1e-5)


def test_a_masked_token_gets_no_gradient_and_a_truncated_one_a_bounded_one():
    """One sample, tokens with rho = e^-1, 1, e^1 (prox = current policy): MIS [0.5, 2] keeps only the middle token's
    gradient; TIS at 2 gives the last token weight 2 instead of e."""
    logp = np.log(np.full((1, 3), 0.4, np.float32))
    batch = {"logp": logp, "loss_mask": np.ones((1, 3), np.float32), "prox_logprobs": logp.copy(),
             "old_logprobs": logp - np.array([[-1.0, 0.0, 1.0]], np.float32), "ref_logprobs": logp.copy(),
             "advantages": np.ones(1, np.float32), "global_tokens": np.float32(3), "global_sequences": np.float32(1)}
    options = dict(off_policy_correction=True, importance_cap=2.0, importance_floor=0.5)
    _, mis_grad, _ = torch_loss_and_grad(build_algorithm(AlgorithmConfig.of("grpo", importance_sampling="mis",
                                                                            **options)), batch)
    _, tis_grad, _ = torch_loss_and_grad(build_algorithm(AlgorithmConfig.of("grpo", **options)), batch)
    np.testing.assert_allclose(mis_grad, [[0.0, -1 / 3, 0.0]], rtol=1e-6, atol=1e-9)
    np.testing.assert_allclose(tis_grad, [[-math.exp(-1) / 3, -1 / 3, -2 / 3]], rtol=1e-6)


@pytest.mark.parametrize("rule, floor, cap, mask_h", [("tis", 0.5, 1.5, None), ("mis", 0.9, 1.1, None),
                                                      ("tis", 0.5, 2.0, 1.3)])
def test_gspo_corrections_weigh_whole_sequences(rule, floor, cap, mask_h):
    """gspo's correction is per sequence: rho is the sample's geometric-mean ratio, and the same rules apply to it."""
    batch = drifted_batch(seed=32)
    algo = build_algorithm(AlgorithmConfig.of(name="gspo", off_policy_correction=True, importance_sampling=rule,
                                              importance_floor=floor, importance_cap=cap, sequence_mask=mask_h))
    w, _, _, _ = weights_reference(batch, rule=rule, cap=cap, floor=floor, mask_h=mask_h, level="sequence")
    per_sample = [set(w[i][batch["loss_mask"][i] > 0].round(9)) for i in range(len(w)) if batch["loss_mask"][i].any()]
    assert all(len(s) == 1 for s in per_sample) and len({s.pop() for s in per_sample}) > 2
    logp, prox, mask = batch["logp"].astype(np.float64), batch["prox_logprobs"], batch["loss_mask"]
    n_seqs = float(batch["global_sequences"])
    ref_loss, ref_grad = 0.0, np.zeros_like(logp)
    for i in range(logp.shape[0]):  # the paper's sequence surrogate with w_i, eps 3e-4 / 4e-4
        tokens = [t for t in range(logp.shape[1]) if mask[i, t]]
        if not tokens:
            continue
        A, wi = float(batch["advantages"][i]), w[i, tokens[0]]
        s = math.exp(sum(logp[i, t] - prox[i, t] for t in tokens) / len(tokens))
        s_clip = min(max(s, 1 - 3e-4), 1 + 4e-4)
        if s * A <= s_clip * A:
            ref_loss += -wi * s * A / n_seqs
            for t in tokens:
                ref_grad[i, t] = -wi * s * A / len(tokens) / n_seqs
        else:
            ref_loss += -wi * s_clip * A / n_seqs
    loss, grad, _ = torch_loss_and_grad(algo, batch)
    assert loss == pytest.approx(ref_loss, rel=1e-5, abs=1e-7)
    np.testing.assert_allclose(grad, ref_grad, rtol=1e-4, atol=1e-7)


def test_cispo_takes_the_same_weights():
    """cispo: per token -w * sg(clip(r)) * A * logp with w the masked weight; d/d logp = -w clip(r) A."""
    batch = drifted_batch(seed=33)
    algo = build_algorithm(AlgorithmConfig.of(name="cispo", off_policy_correction=True, importance_sampling="mis",
                                              sequence_mask=1.5))
    w, _, _, _ = weights_reference(batch, rule="mis", cap=2.0, floor=0.5, mask_h=1.5)
    logp, prox, mask = batch["logp"].astype(np.float64), batch["prox_logprobs"], batch["loss_mask"]
    tokens = float(batch["global_tokens"])
    ref_loss, ref_grad = 0.0, np.zeros_like(logp)
    for i, t in zip(*np.nonzero(mask), strict=True):
        r = min(max(math.exp(logp[i, t] - prox[i, t]), 0.0), 1.28)  # cispo's defaults: eps_low 1, eps_high 0.28
        A = float(batch["advantages"][i])
        ref_loss += -w[i, t] * r * A * logp[i, t] / tokens
        ref_grad[i, t] = -w[i, t] * r * A / tokens
    loss, grad, _ = torch_loss_and_grad(algo, batch)
    assert loss == pytest.approx(ref_loss, rel=1e-5, abs=1e-7)
    np.testing.assert_allclose(grad, ref_grad, rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("name, options", [
    ("grpo", dict(importance_sampling="mis", sequence_mask=1.3, loss_agg="seq_mean")),
    ("rloo", dict(importance_sampling="tis", sequence_mask=1.3)),
    ("gspo", dict(importance_sampling="mis", importance_floor=0.9, importance_cap=1.1)),
    ("cispo", dict(importance_sampling="mis")),
])
def test_splitting_into_micro_batches_and_shards_changes_nothing(name, options):
    batch = drifted_batch(seed=34)
    assert_split_changes_nothing(build_algorithm(AlgorithmConfig.of(name=name, off_policy_correction=True, **options)),
                                 batch)


def test_options_are_checked_naming_the_key():
    with pytest.raises(ConfigError, match=r"algorithm.importance_sampling: mis weights the decoupled objective"):
        build_algorithm(AlgorithmConfig.of("grpo", importance_sampling="mis"))
    with pytest.raises(ConfigError, match=r"algorithm.sequence_mask: .*set algorithm.off_policy_correction: true"):
        build_algorithm(AlgorithmConfig.of("gspo", sequence_mask=1.5))
    with pytest.raises(ConfigError, match=r"algorithm.sequence_mask: must be > 1 \(null: off\)"):
        build_algorithm(AlgorithmConfig.of("grpo", off_policy_correction=True, sequence_mask=0.9))
    with pytest.raises(ConfigError, match=r"algorithm.importance_floor: must be in \[0, 1\]"):
        build_algorithm(AlgorithmConfig.of("cispo", off_policy_correction=True, importance_floor=1.5))
    with pytest.raises(ConfigError, match=r"algorithm.importance_sampling: must be one of tis, mis"):
        build_algorithm(AlgorithmConfig.of("grpo", off_policy_correction=True, importance_sampling="seq"))
    for name in ("ppo", "chord", "on_policy_distill", "reinforce_pp"):  # every policy-gradient algorithm takes them
        options = {"teacher_path": "/t"} if name == "on_policy_distill" else {}
        algo = build_algorithm(AlgorithmConfig.of(name, off_policy_correction=True, importance_sampling="mis",
                                                  sequence_mask=2.0, **options))
        assert algo.supports_replay
