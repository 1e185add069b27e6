"""Staleness policies (`trainer.staleness_policy`): which of the groups read from the experiences topic a step takes,
in which order, and which it evicts. The trainer's feed (rft/trainer/feed.py) keeps a *pool* of admitted groups
(`trainer.staleness_pool` of them, at least run.groups_per_step), read in log order; for each group of a step it asks
the policy which group of the pool to take next (`pick`), after evicting the groups the policy will never take
(`keep` false, counted as `evicted`). The mode's staleness bound is applied before the policy sees a group, and again
to every held group at each step: no policy can train a group the mode forbids.

    in_order              the pool is run.groups_per_step: groups are taken as they arrive (the default; what rft did
                          before policies existed)
    oldest_version_first  the group of the oldest policy version in the pool, then the earliest read (NeMo-RL's
                          weight_fifo): drains stragglers before fresher groups
    windowed              groups with policy_version in [v - k, v] (v: the trainer's version, k:
                          trainer.staleness_window), in the order read; older ones are evicted (NeMo-RL's windowed)
    package.module:Class  a plugin: `Class()` is an object with `keep` and `pick` (the `StalenessPolicy` protocol)

A policy is a pure function of the pool and the version (no state of its own): the pool, which the feed checkpoints
as the offsets of its held records, is all a restarted trainer needs to choose as an uninterrupted one would.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, cast

from rft.config import ConfigError
from rft.registry import RegistryError, import_object
from rft.schema import ExperienceGroup

BUILT_IN = ("in_order", "oldest_version_first", "windowed")


class StalenessPolicy(Protocol):
    """keep(group, version=v): False evicts `group` from the pool for good (counted `evicted`); asked of every
    group when it enters the pool and of every held group at each later step. pick(pool, version=v): the index in
    `pool` (non-empty, in the order read; every group kept) of the group to take next. v = step - 1, the version
    of the weights the step trains (rft/modes.py). Both must be pure: same answer for the same arguments."""

    def keep(self, group: ExperienceGroup, *, version: int) -> bool: ...
    def pick(self, pool: Sequence[ExperienceGroup], *, version: int) -> int: ...


class InOrder:
    """Take the earliest group read."""

    def keep(self, group: ExperienceGroup, *, version: int) -> bool:
        return True

    def pick(self, pool: Sequence[ExperienceGroup], *, version: int) -> int:
        return 0


class OldestVersionFirst(InOrder):
    """Take the group of the oldest policy version, the earliest read among equals."""

    def pick(self, pool: Sequence[ExperienceGroup], *, version: int) -> int:
        return min(range(len(pool)), key=lambda i: (pool[i].policy_version, i))


class Windowed(InOrder):
    """Keep groups with policy_version in [version - window, version]; take the earliest read."""

    def __init__(self, window: int):
        if window < 0:
            raise ValueError(f"trainer.staleness_window: must be >= 0, got {window}")
        self.window = window

    def keep(self, group: ExperienceGroup, *, version: int) -> bool:
        return version - self.window <= group.policy_version <= version


def build_staleness_policy(name: str, *, window: int) -> StalenessPolicy:
    """The policy `trainer.staleness_policy` names (`window`: trainer.staleness_window, windowed's k); ConfigError
    naming the key for a plugin that does not import or lacks `keep` / `pick`."""
    if name == "in_order":
        return InOrder()
    if name == "oldest_version_first":
        return OldestVersionFirst()
    if name == "windowed":
        return Windowed(window)
    try:
        factory = import_object(name, key="trainer.staleness_policy", noun="staleness policy")
    except RegistryError as e:
        raise ConfigError(f"{e} (or one of {', '.join(BUILT_IN)})") from None
    policy = factory()
    missing = [m for m in ("keep", "pick") if not callable(getattr(policy, m, None))]
    if missing:
        raise ConfigError(f"trainer.staleness_policy: {type(policy).__name__} lacks {', '.join(missing)} (the "
                          "StalenessPolicy protocol, rft/experience/staleness_policies.py)")
    return cast(StalenessPolicy, policy)

