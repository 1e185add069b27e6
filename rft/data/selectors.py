"""Task selection: which task the task publisher sends next (`data.selector`), and how task sets mix (`data.mix`).

A pick is a pure function of what was published before, of the reward statistics (`RewardStats`) and of
`data.shuffle_seed` (both read back from the topics after a restart), so a restarted publisher continues the sequence.

- Mixing: each task set has a budget of `len(set) x epochs` picks. The next set is the one with the smallest
  `(picks so far + 1) / weight` among the sets with budget left (ties: the earlier set), so the sets' shares follow
  their weights while all have tasks left, deterministically. A set that is used up drops out.
- A selector then picks a task of that set with visits left (`epochs` visits per task); the TaskRecord's `epoch` is
  the number of earlier visits of the task, so every visit has its own group id.
  - `sequential`: the set in dataset order, once per epoch.
  - `shuffle`: every epoch in its own order, `random.Random(shuffle_seed + epoch + 1000003 x set index)` (no
    shuffle when the seed is null).
  - `curriculum` (online: reads rewards): among the tasks with visits left and not waiting for their last visit's
    rewards (unless all are), a task's weight is `exp(-|mean - target| / temperature)`, `mean` its mean reward over
    every recorded sample (`data.curriculum.prior` before any); temperature 0 takes the closest (ties drawn). Each
    pick draws from `random.Random(shuffle_seed x 1000003 + pick number)`.
- `package.module:factory`: `factory(data: DataConfig)` returns an object with `needs_rewards` (bool) and
  `choose(progress: SetProgress, stats: RewardStats, pick: int) -> task index in progress.tasks`.
"""
from __future__ import annotations

import math
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Protocol

from rft.data.config import DataConfig
from rft.registry import Registry
from rft.schema import ExperienceGroup, TaskRecord

SET_SEED_STRIDE = 1_000_003


class SelectionError(ValueError):
    """A selector that cannot be built from the config, or that chose a task it may not."""


@dataclass
class SetProgress:
    """One task set's tasks (epoch 0, dataset order) and what has been published of them."""
    index: int
    tasks: list[TaskRecord]
    epochs: int  # visits allowed per task
    weight: float
    visits: list[int] = field(default_factory=list)  # per task: times published
    picked: int = 0

    def __post_init__(self) -> None:
        self.visits = self.visits or [0] * len(self.tasks)

    @property
    def budget(self) -> int:
        return len(self.tasks) * self.epochs


class RewardStats:
    """Per-task rewards from experience groups of one run; a group id counts once (explorers deliver at least
    once). Means are exact sums (`math.fsum`), so they do not depend on the order groups were read in."""

    def __init__(self, run_id: str | None = None):
        self.run_id = run_id
        self._rewards: dict[str, list[float]] = {}
        self._groups: dict[str, int] = {}
        self._seen: set[str] = set()

    def add(self, group: ExperienceGroup) -> bool:
        if (self.run_id is not None and group.run_id != self.run_id) or group.group_id in self._seen:
            return False
        self._seen.add(group.group_id)
        self._rewards.setdefault(group.task_id, []).extend(float(r) for r in group.rewards)
        self._groups[group.task_id] = self._groups.get(group.task_id, 0) + 1
        return True

    def mean(self, task_id: str) -> float | None:
        rewards = self._rewards.get(task_id)
        return math.fsum(rewards) / len(rewards) if rewards else None

    def recorded(self, task_id: str) -> int:
        """How many groups (visits) of the task have rewards."""
        return self._groups.get(task_id, 0)

    @property
    def groups(self) -> int:
        return len(self._seen)


class Selector(Protocol):
    needs_rewards: bool

    def choose(self, progress: SetProgress, stats: RewardStats, pick: int) -> int: ...


SELECTORS: Registry[Callable[[DataConfig], Selector]] = Registry("selector", error=SelectionError)
register_selector = SELECTORS.register  # @register_selector(name): `data.selector: <name>`


def build_selector(data: DataConfig) -> Selector:
    """The selector `data.selector` names, built from the `data` section; SelectionError naming the key."""
    factory = SELECTORS.resolve(data.selector, key="data.selector")
    selector = factory(data)
    if not callable(getattr(selector, "choose", None)) or not hasattr(selector, "needs_rewards"):
        raise SelectionError(f"data.selector: {data.selector!r} built a {type(selector).__name__} without "
                             "`needs_rewards` and `choose(progress, stats, pick)`")
    return selector


def selector_needs_rewards(data: DataConfig) -> bool:
    """True when the selector reads rewards, so its tasks are published online (rft/explorer/publisher.py)."""
    return bool(build_selector(data).needs_rewards)


def epoch_order(n: int, epoch: int, shuffle_seed: int | None) -> list[int]:
    order = list(range(n))
    if shuffle_seed is not None:
        random.Random(shuffle_seed + epoch).shuffle(order)
    return order


@register_selector("sequential")
class Sequential:
    needs_rewards = False

    def __init__(self, data: DataConfig):
        pass

    def choose(self, progress: SetProgress, stats: RewardStats, pick: int) -> int:
        return progress.picked % len(progress.tasks)


@register_selector("shuffle")
class Shuffle:
    needs_rewards = False

    def __init__(self, data: DataConfig):
        self.seed = data.shuffle_seed
        self._orders: dict[int, tuple[int, list[int]]] = {}  # set index -> (epoch, its order)

    def choose(self, progress: SetProgress, stats: RewardStats, pick: int) -> int:
        n = len(progress.tasks)
        epoch = progress.picked // n
        cached = self._orders.get(progress.index)
        if cached is None or cached[0] != epoch:
            seed = None if self.seed is None else self.seed + SET_SEED_STRIDE * progress.index
            cached = self._orders[progress.index] = (epoch, epoch_order(n, epoch, seed))
        return cached[1][progress.picked % n]


@register_selector("curriculum")
class Curriculum:
    needs_rewards = True

    def __init__(self, data: DataConfig):
        if data.shuffle_seed is None:
            raise SelectionError("data.shuffle_seed: the curriculum selector needs a seed (got null)")
        self.seed = data.shuffle_seed
        c = data.curriculum
        self.target, self.prior, self.temperature = c.target, c.prior, c.temperature

    def choose(self, progress: SetProgress, stats: RewardStats, pick: int) -> int:
        ids = [t.task_id for t in progress.tasks]
        open_ = [i for i, v in enumerate(progress.visits) if v < progress.epochs]
        ready = [i for i in open_ if stats.recorded(ids[i]) >= progress.visits[i]]
        pool = ready or open_
        distance = [abs(self._mean(stats, ids[i]) - self.target) for i in pool]
        rng = random.Random(self.seed * SET_SEED_STRIDE + pick)
        best = min(distance)
        if self.temperature == 0:
            return rng.choice([i for i, d in zip(pool, distance, strict=True) if d == best])
        return rng.choices(pool, weights=[math.exp(-(d - best) / self.temperature) for d in distance])[0]

    def _mean(self, stats: RewardStats, task_id: str) -> float:
        mean = stats.mean(task_id)
        return self.prior if mean is None else mean


class TaskPicker:
    """The sequence of tasks to publish: which set (by weight), then which of its tasks (by the selector)."""

    def __init__(self, sets: list[SetProgress], selector: Selector):
        self.sets, self.selector = sets, selector
        self._where = {t.task_id: (p, i) for p in sets for i, t in enumerate(p.tasks)}
        self.picks = 0
        self.unknown = 0  # published tasks that are not in the configured task sets (the data changed)

    @property
    def remaining(self) -> int:
        return sum(p.budget - p.picked for p in self.sets)

    def record(self, task_id: str) -> None:
        """Count one published task (a pick of this picker, or one read back from the tasks topic)."""
        self.picks += 1
        if task_id not in self._where:
            self.unknown += 1
            return
        progress, i = self._where[task_id]
        progress.visits[i] += 1
        progress.picked += 1

    def next(self, stats: RewardStats) -> TaskRecord | None:
        """The next task (already recorded as published), or None when every set is used up."""
        progress = min((p for p in self.sets if p.picked < p.budget),
                       key=lambda p: ((p.picked + 1) / p.weight, p.index), default=None)
        if progress is None:
            return None
        i = self.selector.choose(progress, stats, self.picks)
        if not (isinstance(i, int) and 0 <= i < len(progress.tasks) and progress.visits[i] < progress.epochs):
            raise SelectionError(f"data.selector {type(self.selector).__name__} chose task {i!r} of set "
                                 f"{progress.index}, which has no visits left (or does not exist)")
        base = progress.tasks[i]
        task = TaskRecord(run_id=base.run_id, task_id=base.task_id, epoch=progress.visits[i], prompt=base.prompt,
                          answer=base.answer, metadata=base.metadata, images=base.images)
        self.record(task.task_id)
        return task

    def drain(self, stats: RewardStats | None = None) -> Iterator[TaskRecord]:
        """Every remaining pick (with fixed statistics: for selectors that read none)."""
        stats = stats or RewardStats()
        while (task := self.next(stats)) is not None:
            yield task
