"""Evaluation metrics over n sampled responses per task. A sample is *correct* when its reward >= the threshold
(`eval.correct_threshold`; 1.0 by default, i.e. fully right under rewards that give partial credit).

For a task with n samples of which c are correct, every metric is computed per task and averaged over tasks:
- accuracy = c / n, the fraction of correct samples (the same number as pass@1);
- pass@k = 1 - C(n-c, k) / C(n, k): the probability that at least one of k samples drawn without replacement from
  the n is correct; the unbiased estimator of Chen et al. 2021 ("Evaluating Large Language Models Trained on
  Code"), computed with exact integer binomials;
- mean@k = the expected mean reward of k samples drawn from the n, whose unbiased estimate is the mean of all n
  rewards (each sample lies in the same number of k-subsets).
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


def pass_at_k(n: int, c: int, k: int) -> float:
    """1 - C(n-c, k) / C(n, k): P(at least one of k samples out of n, c of them correct, is correct)."""
    if not (0 <= c <= n and 1 <= k <= n):
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n; got n={n}, c={c}, k={k}")
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


@dataclass(frozen=True)
class SetScores:
    """One task set's results. `errors`: tasks the workflow could not run (scored as all samples wrong)."""
    tasks: int
    k: int
    accuracy: float
    pass_at_k: float
    mean_at_k: float
    errors: int = 0

    def metrics(self, set_name: str) -> dict[str, float | int]:
        """The keys logged to metrics.jsonl: `eval/<set>/accuracy`, `eval/<set>/pass@<k>`, `eval/<set>/mean@<k>`."""
        prefix = f"eval/{set_name}"
        return {f"{prefix}/accuracy": self.accuracy, f"{prefix}/pass@{self.k}": self.pass_at_k,
                f"{prefix}/mean@{self.k}": self.mean_at_k, f"{prefix}/tasks": self.tasks,
                f"{prefix}/errors": self.errors}


def score_tasks(rewards: Sequence[Sequence[float]], *, k: int, threshold: float, errors: int = 0) -> SetScores:
    """Scores from each task's sample rewards (every task needs at least k samples)."""
    if not rewards:
        raise ValueError("no tasks to score")
    accuracy = pass_k = mean_k = 0.0
    for i, task_rewards in enumerate(rewards):
        n = len(task_rewards)
        if n < k:
            raise ValueError(f"task {i} has {n} samples, fewer than k={k}")
        c = sum(r >= threshold for r in task_rewards)
        accuracy += c / n
        pass_k += pass_at_k(n, c, k)
        mean_k += sum(task_rewards) / n
    tasks = len(rewards)
    return SetScores(tasks=tasks, k=k, accuracy=accuracy / tasks, pass_at_k=pass_k / tasks, mean_at_k=mean_k / tasks,
                     errors=errors)
