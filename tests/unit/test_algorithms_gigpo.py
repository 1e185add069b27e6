"""gigpo (rft/algorithms/gigpo.py) against a numpy reference written from the paper's definition (Feng et al. 2025,
"Group-in-Group Policy Optimization for LLM Agent Training", Sec. 4: episode-level relative advantage over the
group's returns; step-level relative advantage over the anchor-state groups of discounted returns; A = A_E + w A_S),
on a handcrafted group; and the per-token advantages through the batch builder into the loss."""
from __future__ import annotations

import numpy as np
import pytest

from rft.algorithms import build_algorithm
from rft.algorithms.config import AlgorithmConfig
from rft.schema import ExperienceGroup, Sample, Turn
from rft.trainer.batch import plan_micro_batches, rows_from_groups

GAMMA, OMEGA, EPS = 0.9, 0.5, 1e-6


def sample(index: int, reward: float, turns: list[Turn] | None, response_len: int = 12) -> Sample:
    return Sample(sample_index=index, prompt_tokens=np.arange(1, 4, dtype=np.int32),
                  response_tokens=np.arange(10, 10 + response_len, dtype=np.int32),
                  logprobs=np.full(response_len, -1.0, dtype=np.float32),
                  loss_mask=np.ones(response_len, dtype=np.uint8), reward=reward, turns=turns)


# Three episodes of one task on a lake: states are the player's cell. All start at cell 0; episodes 0 and 1 both
# pass through cell 1; episode 2 goes to cell 4 (met once: a singleton anchor group). Episode 3 has no turns.
GROUP = ExperienceGroup(run_id="r", task_id="t", group_id="g", attempt=0, explorer_id="e", policy_version=0, samples=[
    sample(0, 1.0, [Turn(0, 4, "0", 0.0), Turn(4, 8, "1", 0.0), Turn(8, 11, "2", 1.0)]),
    sample(1, 0.0, [Turn(0, 3, "0", 0.0), Turn(3, 6, "1", 0.3)]),
    sample(2, 0.0, [Turn(1, 5, "0", 0.2), Turn(5, 12, "4", 0.5)]),
    sample(3, 1.0, None),
])


def reference(group: ExperienceGroup) -> list[np.ndarray]:
    """The paper's definition, written out with loops (std with Bessel's correction, as grpo's)."""
    returns = np.array([s.reward for s in group.samples])
    a_episode = (returns - returns.mean()) / (returns.std(ddof=1) + EPS)
    # discounted return-to-go of every step: R_t = r_t + gamma r_{t+1} + gamma^2 r_{t+2} ...
    steps = []  # (episode, turn index, state, R_t)
    for i, s in enumerate(group.samples):
        rewards = [t.reward for t in s.turns or []]
        for t, turn in enumerate(s.turns or []):
            r_t = sum(GAMMA ** (k - t) * rewards[k] for k in range(t, len(rewards)))
            steps.append((i, t, turn.state, r_t))
    out = [np.full(len(s.response_tokens), a_episode[i]) for i, s in enumerate(group.samples)]
    for i, t, state, r_t in steps:
        anchor = np.array([r for (_, _, st, r) in steps if st == state])
        a_step = 0.0 if len(anchor) == 1 else (r_t - anchor.mean()) / (anchor.std(ddof=1) + EPS)
        turn = group.samples[i].turns[t]
        out[i][turn.start:turn.end] = a_episode[i] + OMEGA * a_step
    return out


def gigpo(**options):
    options = {"step_gamma": GAMMA, "step_weight": OMEGA, **options}
    return build_algorithm(AlgorithmConfig(name="gigpo", options=options))


def test_gigpo_matches_the_papers_definition_on_a_handcrafted_group():
    got = gigpo().token_advantages([GROUP])[0]
    want = reference(GROUP)
    for g, w in zip(got, want, strict=True):
        assert g.dtype == np.float32 and g.shape == w.shape
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)
    # hand-checked anchors: cell 1 holds R = 0.9 (episode 0: 0 + 0.9 * 1) and 0.3 (episode 1): +-0.7071 after the
    # normalisation; cell 4 is a singleton: its turn gets the episode advantage only
    a_e = (np.array([1.0, 0, 0, 1]) - 0.5) / (np.std([1.0, 0, 0, 1], ddof=1) + EPS)
    assert got[0][5] == pytest.approx(a_e[0] + OMEGA * 0.7071, abs=1e-3)
    assert got[1][4] == pytest.approx(a_e[1] - OMEGA * 0.7071, abs=1e-3)
    assert got[2][7] == pytest.approx(a_e[2]) and got[2][0] == pytest.approx(a_e[2])  # token 0: outside any turn
    np.testing.assert_allclose(got[3], a_e[3])  # no turns: GRPO
    np.testing.assert_allclose(gigpo().advantages([GROUP.rewards])[0], a_e, rtol=1e-6)  # the scalar: A_E


def test_step_weight_zero_is_grpo_per_token():
    got = gigpo(step_weight=0.0).token_advantages([GROUP])[0]
    grpo = build_algorithm(AlgorithmConfig(name="grpo")).advantages([GROUP.rewards])[0]
    for g, a in zip(got, grpo, strict=True):
        np.testing.assert_allclose(g, a, rtol=1e-6)


def test_per_token_advantages_reach_the_loss_through_the_batch_builder():
    algorithm = gigpo()
    per_token = algorithm.token_advantages([GROUP])
    rows = rows_from_groups([GROUP], algorithm.advantages([GROUP.rewards]), token_advantages=per_token, max_len=13)
    (mb,) = plan_micro_batches(rows, dp_size=1, micro_batch_size=4).for_rank(0)
    start = len(GROUP.samples[0].prompt_tokens) - 1  # target index of the first response token
    assert mb["token_advantages"].shape == mb["loss_mask"].shape
    np.testing.assert_allclose(mb["token_advantages"][0, start:start + 10].numpy(), per_token[0][0][:10])  # cut at 13
    assert float(mb["token_advantages"][0, :start].abs().sum()) == 0.0
    loss, metrics = algorithm.loss_fn(mb["old_logprobs"].clone().requires_grad_(), mb)
    # at the behaviour policy the ratio is 1: the loss is -sum(A_token * mask) / tokens
    want = -(mb["token_advantages"] * mb["loss_mask"]).sum() / mb["global_tokens"]
    assert float(loss.detach()) == pytest.approx(float(want), rel=1e-5)
    grpo_rows = rows_from_groups([GROUP], algorithm.advantages([GROUP.rewards]))
    (plain,) = plan_micro_batches(grpo_rows, dp_size=1, micro_batch_size=4).for_rank(0)
    assert "token_advantages" not in plain  # other algorithms' micro-batches are untouched


def test_token_advantages_of_the_wrong_length_are_refused():
    with pytest.raises(ValueError, match="group g: token advantages not one per response token"):
        rows_from_groups([GROUP], [np.zeros(4)], token_advantages=[[np.zeros(3)] * 4])

