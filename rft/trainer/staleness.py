"""Staleness at the trainer: measure the staleness of each group offered to a step, enforce the mode's bound, and
keep per-step statistics (`StalenessTracker`).

Staleness and each mode's bound are defined in rft/modes.py (`staleness()`, `staleness_bound()`); admission
control at the explorers, which keeps most samples within the bound before they are generated, is
rft/explorer/admission.py. The trainer has the last word: what exceeds the bound is dropped here and counted.
"""
from __future__ import annotations

import collections
from dataclasses import dataclass, field

from rft import modes


@dataclass
class _StepCounts:
    histogram: collections.Counter = field(default_factory=collections.Counter)  # staleness -> samples used
    dropped_stale: int = 0
    dropped_future: int = 0


class StalenessTracker:
    """Computes the staleness of each group offered to step s, decides whether it may be used, and keeps
    per-step statistics. Not thread-safe (the trainer's feed calls it from one thread).

    Rule with a bound k (sync: k = 0, off_policy: k): a group is used iff 0 <= staleness <= k. Above k it is
    dropped and counted in `dropped_stale` (sync mode does the same with k = 0: a stale group after a restart or
    stall is dropped, never used and never fatal). Below 0 (policy_version > s - 1: weights from a lineage the
    trainer abandoned, e.g. versions published after the checkpoint it restarted from) it is dropped and counted
    in `dropped_future`. Without a bound (async, train, offline) every group is used and its staleness recorded
    (offline replay of another run's topic can record negative values). Counts are in samples.
    """

    def __init__(self, *, mode: str, max_staleness: int):
        self.bound = modes.staleness_bound(mode, max_staleness)
        self._steps: dict[int, _StepCounts] = collections.defaultdict(_StepCounts)

    def observe(self, *, step: int, policy_version: int, n_samples: int) -> bool:
        """Record a group of `n_samples` offered to `step`; True if it may be used (and is then counted as used)."""
        if not self.allows(step=step, policy_version=policy_version, n_samples=n_samples):
            return False
        self.used(step=step, policy_version=policy_version, n_samples=n_samples)
        return True

    def allows(self, *, step: int, policy_version: int, n_samples: int) -> bool:
        """Whether a group of `n_samples` may be used in `step`; a refusal is counted (dropped_stale or
        dropped_future), a group allowed is not counted until `used`."""
        staleness, counts = modes.staleness(step, policy_version), self._steps[step]
        if self.bound is not None and staleness > self.bound:
            counts.dropped_stale += n_samples
            return False
        if self.bound is not None and staleness < 0:
            counts.dropped_future += n_samples
            return False
        return True

    def used(self, *, step: int, policy_version: int, n_samples: int) -> None:
        """Count a group of `n_samples` trained in `step` in the staleness histogram."""
        self._steps[step].histogram[modes.staleness(step, policy_version)] += n_samples

    def check(self, group, step: int) -> str | None:
        """`allows` for an ExperienceGroup, in the shape of ExperienceFeed's `admit` callback: None if the group may
        be used, else the skip reason ("stale" or "future_version"). The feed may ask again of a group it holds
        (a staleness policy's pool); the trainer counts what it trains with `used`."""
        if self.allows(step=step, policy_version=group.policy_version, n_samples=len(group.samples)):
            return None
        return "stale" if modes.staleness(step, group.policy_version) > 0 else "future_version"

    def step_metrics(self, step: int) -> dict:
        """Statistics of `step` (and forget them): staleness_mean, staleness_max and staleness_hist (staleness ->
        samples) over the samples used; dropped_stale and dropped_future in samples."""
        counts = self._steps.pop(step, _StepCounts())
        used = sum(counts.histogram.values())
        total = sum(s * n for s, n in counts.histogram.items())
        return {"staleness_mean": total / used if used else 0.0,
                "staleness_max": max(counts.histogram, default=0),
                "staleness_hist": dict(sorted(counts.histogram.items())),
                "dropped_stale": counts.dropped_stale,
                "dropped_future": counts.dropped_future}
