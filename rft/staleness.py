"""Staleness: admission control for explorers, measurement and enforcement for the trainer.

Definitions (DESIGN.md). Version 0 is the initial weights; optimizer step s consumes one batch of B groups
(`trainer.groups_per_step`) and produces version s. A sample generated with weights `policy_version` and used in
step s has staleness (s - 1) - policy_version. The bound k depends on the mode: sync 0, off_policy
`run.max_staleness`, and none for async, explore, train and offline.

`AdmissionController` (explorer side) is AReaL's staleness manager, counted in groups:
    capacity = (k + version + 1) * B - (accepted + running)
where `version` is the policy version of the weights the explorers generate with, `accepted` counts finished
groups that will take a training slot and `running` counts admitted groups not yet finished. Why it bounds
staleness: the trainer takes B groups per step in arrival order, so the j-th slot (1-based) is trained in step
ceil(j / B). A group admitted at version w holds one of the first (k + w + 1) * B slots, so if groups finish in
the order they were admitted it is trained in a step s <= k + w + 1, i.e. with staleness <= k. A straggler that is
overtaken by later rollouts can still exceed k; the trainer's `StalenessTracker` drops and counts it.

State that rebuilds a controller (after an explorer or trainer restart, or to correct drift):
- `version`: the newest policy version the explorers have loaded (control topic / weight store);
- `trainer_version`: optimizer steps completed = the step of the trainer's latest checkpoint;
- `backlog`: groups in the experiences topic after the trainer's consumed offsets *as of that step* (end offsets
  minus the offsets stored with that checkpoint); groups taken for a step still in progress are backlog.
Then accepted = trainer_version * B + backlog (`resync`). Rollouts that were running in a dead explorer are gone
(their tasks are re-explored), so `running` restarts at 0. Counting slots rather than all groups ever accepted
matters because groups the trainer drops never take a slot: a plain count would shrink capacity for good.
"""
from __future__ import annotations

import collections
import dataclasses
import sys
import threading
from dataclasses import dataclass, field
from typing import Optional

UNBOUNDED_MODES = ("async", "explore", "train", "offline")


def staleness_bound(mode: str, max_staleness: int) -> Optional[int]:
    """The largest staleness a sample may have when used: 0 (sync), k (off_policy) or None (no bound)."""
    if mode == "sync":
        return 0
    if mode == "off_policy":
        if max_staleness < 0:
            raise ValueError(f"run.max_staleness: must be >= 0, got {max_staleness}")
        return max_staleness
    if mode in UNBOUNDED_MODES:
        return None
    raise ValueError(f"run.mode: unknown mode {mode!r} (sync, off_policy, {', '.join(UNBOUNDED_MODES)})")


# ------------------------------------------------------------------------------------------------ explorer side

@dataclass(frozen=True)
class AdmissionState:
    version: int
    accepted: int
    running: int


class AdmissionController:
    """Decides how many new groups the explorers may start now. Thread-safe (one lock around the counters).

    Use: `n = reserve(wanted)` before starting rollouts, then `finish()` for each group written to the experiences
    topic or `fail()` for each given up; `set_version(v)` after loading weights v.
    """

    def __init__(self, *, groups_per_step: int, max_staleness: Optional[int], version: int = 0,
                 accepted: int = 0, max_running: Optional[int] = None):
        if groups_per_step < 1:
            raise ValueError(f"trainer.groups_per_step: must be >= 1, got {groups_per_step}")
        if max_running is not None and max_running < 1:
            raise ValueError(f"max_running: must be >= 1 or None, got {max_running}")
        self.groups_per_step, self.max_staleness, self.max_running = groups_per_step, max_staleness, max_running
        self._state = AdmissionState(version=version, accepted=accepted, running=0)
        self._lock = threading.Lock()

    @classmethod
    def for_mode(cls, mode: str, *, max_staleness: int, groups_per_step: int, **kwargs) -> "AdmissionController":
        return cls(groups_per_step=groups_per_step, max_staleness=staleness_bound(mode, max_staleness), **kwargs)

    def capacity(self) -> int:
        """Groups that may be started now (<= 0: none)."""
        with self._lock:
            return self._capacity()

    def reserve(self, n: int) -> int:
        """Admit up to `n` groups; returns how many were admitted (they count as running)."""
        if n < 0:
            raise ValueError(f"reserve: n must be >= 0, got {n}")
        with self._lock:
            granted = max(0, min(n, self._capacity()))
            self._update(running=self._state.running + granted)
            return granted

    def finish(self, n: int = 1) -> None:
        """`n` admitted groups were written to the experiences topic."""
        with self._lock:
            self._release(n, "finish")
            self._update(accepted=self._state.accepted + n)

    def fail(self, n: int = 1) -> None:
        """`n` admitted groups were given up (their tasks will be explored again); their slots are free."""
        with self._lock:
            self._release(n, "fail")

    def set_version(self, version: int) -> None:
        """The explorers now generate with weights `version` (never decreases)."""
        with self._lock:
            if version < self._state.version:
                raise ValueError(f"set_version: version {version} is older than the current {self._state.version}")
            self._update(version=version)

    def resync(self, *, trainer_version: int, backlog: int) -> None:
        """Recount accepted groups from what Kafka and the trainer say (see the module docstring)."""
        if trainer_version < 0 or backlog < 0:
            raise ValueError(f"resync: trainer_version and backlog must be >= 0, got {trainer_version}, {backlog}")
        with self._lock:
            self._update(accepted=trainer_version * self.groups_per_step + backlog)

    def state(self) -> AdmissionState:
        with self._lock:
            return self._state

    def _capacity(self) -> int:
        s = self._state
        by_concurrency = sys.maxsize if self.max_running is None else self.max_running - s.running
        if self.max_staleness is None:
            return by_concurrency
        by_staleness = (self.max_staleness + s.version + 1) * self.groups_per_step - (s.accepted + s.running)
        return min(by_concurrency, by_staleness)

    def _release(self, n: int, what: str) -> None:
        if not 0 <= n <= self._state.running:
            raise ValueError(f"{what}({n}) with {self._state.running} groups running")
        self._update(running=self._state.running - n)

    def _update(self, **changes: int) -> None:
        self._state = dataclasses.replace(self._state, **changes)


# ------------------------------------------------------------------------------------------------- trainer side

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
        self.bound = staleness_bound(mode, max_staleness)
        self._steps: dict[int, _StepCounts] = collections.defaultdict(_StepCounts)

    @staticmethod
    def staleness(step: int, policy_version: int) -> int:
        return (step - 1) - policy_version

    def observe(self, *, step: int, policy_version: int, n_samples: int) -> bool:
        """Record a group of `n_samples` offered to `step`; True if it may be used."""
        staleness, counts = self.staleness(step, policy_version), self._steps[step]
        if self.bound is not None and staleness > self.bound:
            counts.dropped_stale += n_samples
            return False
        if self.bound is not None and staleness < 0:
            counts.dropped_future += n_samples
            return False
        counts.histogram[staleness] += n_samples
        return True

    def check(self, group, step: int) -> Optional[str]:
        """`observe` for an ExperienceGroup, in the shape of ExperienceFeed's `admit` callback: None to use the
        group, else the skip reason ("stale" or "future_version")."""
        if self.observe(step=step, policy_version=group.policy_version, n_samples=len(group.samples)):
            return None
        return "stale" if self.staleness(step, group.policy_version) > 0 else "future_version"

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
