"""Evaluation metrics against brute force: pass@k against enumerating every k-subset of a task's n samples, and
accuracy / mean@k against plain numpy over random rewards (mean@k as the mean over all k-subsets, which checks that
the mean of the n rewards is its unbiased estimate)."""
from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from rft.evaluation.metrics import pass_at_k, score_tasks


def pass_at_k_by_enumeration(n: int, c: int, k: int) -> float:
    """The fraction of k-subsets of n samples (the first c correct) that hold at least one correct sample."""
    subsets = list(itertools.combinations(range(n), k))
    return sum(any(i < c for i in subset) for subset in subsets) / len(subsets)


@pytest.mark.parametrize("n", range(1, 10))
def test_pass_at_k_equals_enumeration(n):
    for c in range(n + 1):
        for k in range(1, n + 1):
            assert pass_at_k(n, c, k) == pytest.approx(pass_at_k_by_enumeration(n, c, k), abs=1e-12), (n, c, k)


def test_pass_at_k_edges_and_large_n():
    assert pass_at_k(10, 0, 3) == 0.0 and pass_at_k(10, 8, 3) == 1.0  # fewer than k wrong samples: certain
    assert pass_at_k(10, 3, 1) == pytest.approx(0.3)  # pass@1 is the fraction correct
    # exact integer binomials stay finite where floating-point factorials overflow
    assert pass_at_k(2000, 1, 1000) == pytest.approx(0.5)
    assert pass_at_k(2000, 2, 1000) == pytest.approx(1 - (1000 * 999) / (2000 * 1999))
    for n, c, k in ((3, 4, 1), (3, 1, 4), (3, 1, 0), (3, -1, 1)):
        with pytest.raises(ValueError, match="pass@k"):
            pass_at_k(n, c, k)


@pytest.mark.parametrize("threshold", [1.0, 0.5])
def test_set_scores_match_brute_force(threshold):
    rng = np.random.default_rng(3)
    n, k, tasks = 6, 3, 40
    # rewards like char_accuracy's: 0, 0.25 (in the alphabet) or 1 (right), plus a few continuous ones
    rewards = rng.choice([0.0, 0.25, 1.0], size=(tasks, n), p=[0.3, 0.4, 0.3])
    rewards[::7] = rng.uniform(0, 1, size=rewards[::7].shape)
    scores = score_tasks(rewards.tolist(), k=k, threshold=threshold, errors=2)

    correct = rewards >= threshold
    subsets = list(itertools.combinations(range(n), k))
    expected_pass = np.mean([np.mean([correct[t, list(s)].any() for s in subsets]) for t in range(tasks)])
    expected_mean = np.mean([np.mean([rewards[t, list(s)].mean() for s in subsets]) for t in range(tasks)])
    assert scores.tasks == tasks and scores.k == k and scores.errors == 2
    assert scores.accuracy == pytest.approx(correct.mean(), abs=1e-12)
    assert scores.pass_at_k == pytest.approx(expected_pass, abs=1e-12)
    assert scores.mean_at_k == pytest.approx(expected_mean, abs=1e-12)
    assert scores.metrics("copy") == {"eval/copy/accuracy": scores.accuracy, "eval/copy/pass@3": scores.pass_at_k,
                                      "eval/copy/mean@3": scores.mean_at_k, "eval/copy/tasks": tasks,
                                      "eval/copy/errors": 2}


def test_tasks_are_weighted_equally_whatever_their_sample_count():
    scores = score_tasks([[1.0, 0.0], [1.0, 1.0, 1.0, 0.0]], k=2, threshold=1.0)
    assert scores.accuracy == pytest.approx((1 / 2 + 3 / 4) / 2)
    assert scores.pass_at_k == pytest.approx((1.0 + (1 - 0 / math.comb(4, 2))) / 2)


def test_score_tasks_rejects_too_few_samples():
    with pytest.raises(ValueError, match="task 1 has 1 samples, fewer than k=2"):
        score_tasks([[1.0, 0.0], [1.0]], k=2, threshold=1.0)
    with pytest.raises(ValueError, match="no tasks"):
        score_tasks([], k=1, threshold=1.0)
