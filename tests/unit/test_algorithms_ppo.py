"""ppo against textbook computations written independently in NumPy: GAE against the backward loop over each row's
response tokens, whitening against numpy's mean/std, the value loss and the per-token clipped surrogate in value and
gradient, and all of it unchanged under micro-batch and data-parallel splits. Batches and split helpers are
test_algorithms.py's."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from test_algorithms import loss_over_parts, ppo_reference, random_batch, to_torch, torch_loss_and_grad

from rft.algorithms import build_algorithm
from rft.algorithms.config import AlgorithmConfig
from rft.algorithms.ppo import gae, token_moments
from rft.config import ConfigError


def gae_reference(rewards, values, mask, gamma, lam):
    """Textbook GAE per row: the response is the masked positions in order, the reward sits on the last one."""
    adv, ret = np.zeros(values.shape), np.zeros(values.shape)
    for i in range(values.shape[0]):
        steps = [t for t in range(values.shape[1]) if mask[i, t] > 0]
        running = 0.0
        for k in reversed(range(len(steps))):
            t = steps[k]
            last = k == len(steps) - 1
            r = float(rewards[i]) if last else 0.0
            v_next = 0.0 if last else float(values[i, steps[k + 1]])
            delta = r + gamma * v_next - float(values[i, t])
            running = delta + gamma * lam * running
            adv[i, t] = running
            ret[i, t] = running + float(values[i, t])
    return adv, ret


def ppo_batch(seed: int, *, rows: int = 7, gaps: bool = True) -> dict[str, np.ndarray]:
    """random_batch plus values and rewards; with `gaps` some rows have a hole in the mask (tool output)."""
    batch = random_batch(seed, rows=rows, length=11)
    rng = np.random.default_rng(seed + 70)
    if gaps:
        for i in range(0, rows - 1, 3):
            on = np.flatnonzero(batch["loss_mask"][i])
            if len(on) >= 3:
                batch["loss_mask"][i, on[1]] = 0.0
        batch["global_tokens"] = np.float32(batch["loss_mask"].sum())
    batch["values"] = (rng.normal(0, 1, batch["logp"].shape) * batch["loss_mask"]).astype(np.float32)
    batch["advantages"] = rng.normal(0.5, 1, rows).astype(np.float32)  # ppo: the per-sample channel is the reward
    return batch


def micro(batch, rows=None):
    _, mb = to_torch(batch)
    if rows is None:
        return mb
    index = torch.as_tensor(rows)
    return {k: (v[index] if v.ndim else v) for k, v in mb.items()}


@pytest.mark.parametrize("gamma, lam", [(1.0, 0.95), (0.9, 0.5), (1.0, 1.0), (0.99, 0.0)])
def test_gae_matches_the_textbook_loop(gamma, lam):
    batch = ppo_batch(seed=31)
    assert any(np.diff(np.flatnonzero(m)).max(initial=1) > 1 for m in batch["loss_mask"]), "need a row with a gap"
    adv, ret = gae(torch.as_tensor(batch["advantages"]), torch.as_tensor(batch["values"]),
                   torch.as_tensor(batch["loss_mask"]), gamma=gamma, lam=lam)
    ref_adv, ref_ret = gae_reference(batch["advantages"], batch["values"], batch["loss_mask"], gamma, lam)
    np.testing.assert_allclose(adv.numpy(), ref_adv, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(ret.numpy(), ref_ret, rtol=1e-5, atol=1e-6)
    if lam == 1.0 and gamma == 1.0:  # Monte-Carlo: every return is the reward
        on = batch["loss_mask"] > 0
        np.testing.assert_allclose(ret.numpy()[on], np.broadcast_to(batch["advantages"][:, None], on.shape)[on],
                                   rtol=1e-5)


@pytest.mark.parametrize("whiten", [True, False])
def test_targets_are_the_same_for_any_micro_batch_and_data_parallel_split(whiten):
    batch = ppo_batch(seed=32, rows=12)
    algo = build_algorithm(AlgorithmConfig.of(name="ppo", whiten_advantages=whiten, gamma=0.97, lam=0.9))
    values = torch.as_tensor(batch["values"])
    whole = algo.add_targets([micro(batch)], [values])[0]
    ref_adv, ref_ret = gae_reference(batch["advantages"], batch["values"], batch["loss_mask"], 0.97, 0.9)
    on = batch["loss_mask"] > 0
    if whiten:
        ref_adv[on] = (ref_adv[on] - ref_adv[on].mean()) / (ref_adv[on].std() + 1e-8)
    np.testing.assert_allclose(whole["token_advantages"].numpy(), ref_adv, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(whole["returns"].numpy(), ref_ret, rtol=1e-5, atol=1e-6)
    # 2 data-parallel ranks (rows dealt round-robin), each with its own micro-batches; the moments are summed
    # over ranks as the trainer's all-reduce does.
    rows = np.arange(12)
    shards = [[rows[0::2][:3], rows[0::2][3:]], [rows[1::2][:2], rows[1::2][2:]]]
    local = [[micro(batch, r) for r in shard] for shard in shards]
    moments = sum(token_moments([gae(mb["advantages"], values[torch.as_tensor(r)], mb["loss_mask"], gamma=0.97,
                                     lam=0.9)[0] for mb, r in zip(mbs, shard, strict=True)],
                                [mb["loss_mask"] for mb in mbs])
                  for mbs, shard in zip(local, shards, strict=True))
    for mbs, shard in zip(local, shards, strict=True):
        parts = algo.add_targets(mbs, [values[torch.as_tensor(r)] for r in shard], lambda _local: moments)
        for part, r in zip(parts, shard, strict=True):
            for key in ("token_advantages", "returns", "values"):
                np.testing.assert_allclose(part[key].numpy(), whole[key].numpy()[r], rtol=1e-5, atol=1e-6,
                                           err_msg=key)


def value_reference(b, v, *, clip, agg):
    """0.5 max((v - R)^2, (clip(v, old - eps, old + eps) - R)^2) per loss token, aggregated; and d/dv."""
    old, ret, mask = b["values"], b["returns"], b["loss_mask"]
    loss, grad, clipped_n = 0.0, np.zeros(v.shape), 0
    for i in range(v.shape[0]):
        length = mask[i].sum()
        for t in range(v.shape[1]):
            if mask[i, t] == 0:
                continue
            scale = 1.0 / b["global_tokens"] if agg == "token_mean" else 1.0 / (length * b["global_sequences"])
            a = (v[i, t] - ret[i, t]) ** 2
            d_a = 2 * (v[i, t] - ret[i, t])
            if clip is not None:
                vc = min(max(v[i, t], old[i, t] - clip), old[i, t] + clip)
                c = (vc - ret[i, t]) ** 2
                if c > a:
                    a, d_a = c, (2 * (vc - ret[i, t]) if old[i, t] - clip < v[i, t] < old[i, t] + clip else 0.0)
                    clipped_n += 1
            loss += scale * 0.5 * a
            grad[i, t] = scale * 0.5 * d_a
    return loss, grad, clipped_n / b["global_tokens"]


@pytest.mark.parametrize("agg", ["token_mean", "seq_mean"])
@pytest.mark.parametrize("clip", [0.2, None])
def test_value_loss_and_gradient_match_textbook(agg, clip):
    batch = ppo_batch(seed=33)
    batch["returns"] = (np.random.default_rng(5).normal(0, 1, batch["logp"].shape) * batch["loss_mask"]).astype(
        np.float32)
    current = (batch["values"] + np.random.default_rng(6).normal(0, 0.4, batch["logp"].shape)).astype(np.float32)
    algo = build_algorithm(AlgorithmConfig.of(name="ppo", loss_agg=agg, value_clip=clip))
    v = torch.tensor(current, requires_grad=True)
    loss, metrics = algo.value_loss_fn(v, micro(batch))
    loss.backward()
    ref_loss, ref_grad, clip_frac = value_reference(batch, current.astype(np.float64), clip=clip, agg=agg)
    assert loss.item() == pytest.approx(ref_loss, rel=1e-5)
    np.testing.assert_allclose(v.grad.numpy(), ref_grad, rtol=1e-4, atol=1e-7)
    assert metrics["value_clip_frac"].item() == pytest.approx(clip_frac, abs=1e-6)
    if clip is not None:
        assert clip_frac > 0.05, "the batch must exercise value clipping"


@pytest.mark.parametrize("agg", ["token_mean", "seq_mean"])
def test_policy_loss_is_the_clipped_surrogate_with_per_token_advantages(agg):
    batch = ppo_batch(seed=34)
    algo = build_algorithm(AlgorithmConfig.of(name="ppo", loss_agg=agg, kl_coef=0.1))
    targets = algo.add_targets([micro(batch)], [torch.as_tensor(batch["values"])])[0]
    batch = {**batch, **{k: targets[k].numpy() for k in ("token_advantages", "returns")}}
    loss, grad, metrics = torch_loss_and_grad(algo, batch)
    ref_loss, ref_grad, clip_frac, _ = ppo_reference(batch, clip_eps=0.2, agg=agg, kl_coef=0.1,
                                                    token_advantages=batch["token_advantages"])
    assert loss == pytest.approx(ref_loss, rel=1e-5, abs=1e-6)
    np.testing.assert_allclose(grad, ref_grad, rtol=1e-4, atol=1e-6)
    assert metrics["clip_frac"] == pytest.approx(clip_frac, abs=1e-6) and clip_frac > 0.05


@pytest.mark.parametrize("agg", ["token_mean", "seq_mean"])
def test_policy_and_value_losses_are_unchanged_by_micro_batch_and_data_parallel_splits(agg):
    batch = ppo_batch(seed=35, rows=12)
    algo = build_algorithm(AlgorithmConfig.of(name="ppo", loss_agg=agg))
    targets = algo.add_targets([micro(batch)], [torch.as_tensor(batch["values"])])[0]
    batch = {**batch, "token_advantages": targets["token_advantages"].numpy(), "returns": targets["returns"].numpy()}
    rows = np.arange(12)
    parts = [rows[0::2][:3], rows[0::2][3:], rows[1::2][:2], rows[1::2][2:4], rows[1::2][4:]]
    whole, split = loss_over_parts(algo, batch, [rows]), loss_over_parts(algo, batch, parts)
    assert split[0] == pytest.approx(whole[0], rel=1e-5, abs=1e-7)
    np.testing.assert_allclose(split[1], whole[1], rtol=1e-5, atol=1e-7)
    current = torch.tensor(batch["values"] + 0.3, requires_grad=True)
    whole_v = algo.value_loss_fn(current, micro(batch))[0]
    split_v = sum(algo.value_loss_fn(current[torch.as_tensor(r)], micro(batch, r))[0] for r in parts)
    assert split_v.item() == pytest.approx(whole_v.item(), rel=1e-5)
    g_whole = torch.autograd.grad(whole_v, current)[0]
    g_split = torch.autograd.grad(split_v, current)[0]
    np.testing.assert_allclose(g_split.numpy(), g_whole.numpy(), rtol=1e-5, atol=1e-8)


def test_advantages_pass_the_rewards_through_and_config_is_checked():
    algo = build_algorithm(AlgorithmConfig.of(name="ppo"))
    out = algo.advantages([np.array([1.0, 0.0]), np.array([0.25])])
    assert [a.tolist() for a in out] == [[1.0, 0.0], [0.25]]
    assert algo.needs.critic.path is None and algo.needs.critic.lr == 1e-5 and not algo.supports_replay
    assert build_algorithm(AlgorithmConfig.of(name="ppo", critic_path="/c")).needs.critic.path == "/c"
    with pytest.raises(ConfigError, match="algorithm.lam"):
        build_algorithm(AlgorithmConfig.of(name="ppo", lam=1.5))
    with pytest.raises(ConfigError, match="algorithm.value_clip"):
        build_algorithm(AlgorithmConfig.of(name="ppo", value_clip=0.0))
    with pytest.raises(ConfigError, match="algorithm.critic_lr"):
        build_algorithm(AlgorithmConfig.of(name="ppo", critic_lr=0.0))
    with pytest.raises(ValueError, match="values of micro-batch 0"):
        algo.add_targets([micro(ppo_batch(seed=1))], [torch.zeros(2, 2)])


def test_a_critic_of_another_vocabulary_is_refused_naming_the_key(tiny_model, tmp_path):
    from rft.models.tiny import make_tiny_model
    from rft.run.config import config_from_dict
    from rft.run.loading import check_model

    wide = make_tiny_model(tmp_path / "wide", vocab_size=101)
    cfg = config_from_dict({"run": {"name": "run", "mode": "train", "output_dir": str(tmp_path)},
                            "model": {"path": str(tiny_model)},
                            "algorithm": {"name": "ppo", "critic_path": str(wide)}})
    with pytest.raises(ConfigError, match=f"run.yaml: algorithm.critic_path: the critic {wide} has vocab_size 101"):
        check_model(cfg, "run.yaml", need_model=True)
    same = config_from_dict({"run": {"name": "run", "mode": "train", "output_dir": str(tmp_path)},
                             "model": {"path": str(tiny_model)},
                             "algorithm": {"name": "ppo", "critic_path": str(tiny_model)}})
    check_model(same, "run.yaml", need_model=True)
