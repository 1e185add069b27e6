"""The replay buffer's priorities and choice against plain-python references: priorities = score x decay^age
(statistics.pvariance of the rewards for `reward_variance`); the seeded choice draws with the probabilities of
successive weighted sampling without replacement (computed exactly by enumeration); the reuse limit holds; the
choice is a pure function of the saved state, so a JSON round trip (a checkpoint) mid-way changes nothing."""
from __future__ import annotations

import collections
import itertools
import json
import math
import statistics

import numpy as np
import pytest

from rft.experience.priorities import PRIORITIES, resolve_priority
from rft.trainer.replay_buffer import Candidate, ReplayBuffer
from tests.records import make_group


def buffer_with(scores: list[float], *, first_steps: list[int] | None = None, decay: float = 1.0,
                max_reuse: int = 3, seed: int = 7) -> ReplayBuffer:
    steps = first_steps or [1] * len(scores)
    buffer = ReplayBuffer(max_reuse=max_reuse, decay=decay, capacity=100, seed=seed)
    buffer.add([Candidate("t.experiences:0", i, f"g{i}", s, step)
                for i, (s, step) in enumerate(zip(scores, steps, strict=True))])
    return buffer


def test_priorities_are_recency_decayed_reward_variance():
    groups = [make_group("run", i, n_samples=5) for i in range(6)]
    score = resolve_priority("reward_variance")
    first_steps = [1, 2, 2, 4, 7, 9]
    buffer = buffer_with([score(g) for g in groups], first_steps=first_steps, decay=0.8)
    expected = [statistics.pvariance([s.reward for s in g.samples]) * 0.8 ** (10 - first)
                for g, first in zip(groups, first_steps, strict=True)]
    assert buffer.priorities(10).tolist() == pytest.approx(expected, rel=1e-12)
    assert PRIORITIES["uniform"](groups[0]) == 1.0


def inclusion_probabilities(weights: list[float], k: int) -> list[float]:
    """P(item i is among k successive draws without replacement, each proportional to weight), by enumeration."""
    total = [0.0] * len(weights)
    for sequence in itertools.permutations(range(len(weights)), k):
        p, left = 1.0, sum(weights)
        for i in sequence:
            p *= weights[i] / left
            left -= weights[i]
        for i in sequence:
            total[i] += p
    return total


def test_choice_frequencies_match_successive_weighted_sampling():
    weights, k, trials = [1.0, 2.0, 3.0, 0.5, 6.0], 2, 6000
    buffer = buffer_with(weights)
    counts, first = collections.Counter(), collections.Counter()
    for step in range(1, trials + 1):
        chosen = buffer.choose(k, step)
        assert len({c.group_id for c in chosen}) == k
        counts.update(c.offset for c in chosen)
        first[chosen[0].offset] += 1
    for i, p in enumerate(inclusion_probabilities(weights, k)):
        sigma = math.sqrt(p * (1 - p) / trials)
        assert abs(counts[i] / trials - p) < 4.5 * sigma, (i, counts[i] / trials, p)
    for i, w in enumerate(weights):  # the first pick is one weighted draw
        p = w / sum(weights)
        assert abs(first[i] / trials - p) < 4.5 * math.sqrt(p * (1 - p) / trials), (i, first[i] / trials, p)


def test_zero_priority_is_never_chosen_and_never_kept():
    buffer = ReplayBuffer(max_reuse=1, decay=1.0, capacity=10, seed=0)
    buffer.add([Candidate("t:0", 0, "flat", 0.0, 1), Candidate("t:0", 1, "varied", 0.3, 1)])
    assert [c.group_id for c in buffer.candidates] == ["varied"]
    assert [c.group_id for c in buffer.choose(5, 2)] == ["varied"]
    assert ReplayBuffer(max_reuse=1, decay=1.0, capacity=10, seed=0).choose(3, 1) == []


def test_capacity_forgets_the_oldest():
    buffer = ReplayBuffer(max_reuse=1, decay=1.0, capacity=3, seed=0)
    for step in range(1, 4):
        buffer.add([Candidate("t:0", 2 * step + j, f"g{2 * step + j}", 1.0, step) for j in range(2)])
    assert [c.offset for c in buffer.candidates] == [5, 6, 7]


def simulate(buffer: ReplayBuffer, steps: range, *, per_step: int, fresh: int, rng_seed: int = 3,
             offset_base: int = 0) -> list[tuple[int, str, int]]:
    """The trainer's order per step: choose, mark replayed, then add the step's fresh groups. Returns
    (step, group id, reuse) for every group trained, fresh ones with reuse 0."""
    trained = []
    for step in steps:
        chosen = buffer.choose(per_step, step)
        reuse = [c.reuse + 1 for c in chosen]
        buffer.mark_replayed(chosen)
        rng = np.random.default_rng([rng_seed, step])
        new = [Candidate("t:0", offset_base + step * fresh + j, f"g{step}-{j}",
                         float(rng.random() < 0.8) * rng.random(), step) for j in range(fresh)]
        buffer.add(new)
        trained += [(step, c.group_id, 0) for c in new]
        trained += [(step, c.group_id, r) for c, r in zip(chosen, reuse, strict=True)]
    return trained


def test_reuse_limit_holds_and_fresh_groups_wait_a_step():
    trained = simulate(ReplayBuffer(max_reuse=2, decay=0.9, capacity=50, seed=11), range(1, 61), per_step=3, fresh=2)
    uses = collections.defaultdict(list)
    for step, group, reuse in trained:
        uses[group].append((step, reuse))
    replayed = {g: u for g, u in uses.items() if len(u) > 1}
    assert replayed, "nothing was replayed"
    assert max(len(u) for u in uses.values()) == 3  # fresh + max_reuse, reached by some group
    for group, history in uses.items():
        steps = [s for s, _ in history]
        assert [r for _, r in history] == list(range(len(history))), group  # 0, 1, 2 in order
        assert len(set(steps)) == len(steps) and steps[0] < min(steps[1:], default=steps[0] + 1), group
    per_step = collections.Counter(step for step, _, reuse in trained if reuse)
    assert max(per_step.values()) <= 3


def test_resume_from_saved_state_reproduces_the_sequence():
    uninterrupted = simulate(ReplayBuffer(max_reuse=2, decay=0.7, capacity=8, seed=5), range(1, 41),
                             per_step=2, fresh=3)
    first = ReplayBuffer(max_reuse=2, decay=0.7, capacity=8, seed=5)
    before = simulate(first, range(1, 18), per_step=2, fresh=3)
    saved = json.loads(json.dumps(first.to_json()))  # what the checkpoint holds
    restored = ReplayBuffer(max_reuse=2, decay=0.7, capacity=8, seed=5)
    restored.load_json(saved)
    assert before + simulate(restored, range(18, 41), per_step=2, fresh=3) == uninterrupted
    other_seed = simulate(ReplayBuffer(max_reuse=2, decay=0.7, capacity=8, seed=6), range(1, 41), per_step=2, fresh=3)
    assert other_seed != uninterrupted  # the seed matters: the test can tell sequences apart


def test_unknown_priority_names_the_registry():
    with pytest.raises(ValueError, match="unknown priority 'variance'.*reward_variance, uniform"):
        resolve_priority("variance")
    assert resolve_priority("statistics:pvariance") is statistics.pvariance  # an import path resolves
