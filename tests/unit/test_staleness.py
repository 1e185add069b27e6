"""Admission control and staleness tracking: known inputs, then simulated runs (explorers, topic, trainer). The
simulation drives the production admission object (rft/explorer/admission.py) through an in-memory feed."""
from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

import numpy as np
import pytest

from rft.explorer.admission import KEEP_FLOOR, KEEP_MARGIN, AdmissionState, FleetReading, fleet_capacity
from rft.explorer.admission import StalenessAdmission as AdmissionController
from rft.modes import admission_bound, staleness_bound
from rft.schema import ExperienceGroup, Sample
from rft.trainer.staleness import StalenessTracker


class InMemoryFeed:
    """A FleetFeed: each reading published is read once, as a coordinator's announcement would be."""

    def __init__(self):
        self.pending: FleetReading | None = None

    def publish(self, *, trainer_version: int, backlog: int, in_batch: int = 0, keep: float = 1.0) -> None:
        self.pending = FleetReading(trainer_version=trainer_version, backlog=backlog, in_batch=in_batch, keep=keep)

    def read(self) -> FleetReading | None:
        reading, self.pending = self.pending, None
        return reading

    def close(self) -> None:
        pass


# ---------------------------------------------------------------------------------------------- known inputs


def test_capacity_follows_the_formula_through_reserve_finish_fail_version_and_resync():
    ctrl = AdmissionController(groups_per_step=4, max_staleness=1)
    assert ctrl.capacity() == (1 + 0 + 1) * 4  # 8
    assert ctrl.reserve(10) == 8 and ctrl.capacity() == 0 and ctrl.reserve(1) == 0
    ctrl.finish(3)  # accepted 3 + running 5: still full
    assert ctrl.capacity() == 0 and ctrl.state() == AdmissionState(version=0, accepted=3, running=5)
    ctrl.set_version(1)
    assert ctrl.capacity() == (1 + 1 + 1) * 4 - 8  # 4
    ctrl.fail(1)
    assert ctrl.capacity() == 5
    ctrl.resync(trainer_version=1, backlog=2)  # accepted = 1 * 4 + 2
    assert ctrl.state() == AdmissionState(version=1, accepted=6, running=4)
    assert ctrl.capacity() == 12 - 10


def test_the_fleets_shares_add_up_to_the_capacity_even_when_it_is_smaller_than_the_fleet():
    """Each explorer starts its share of (k + version + 1) * B - accepted_fleet: c // n, plus one for the c % n
    lowest ranks. 8 explorers in sync mode with B = 4 start 4 groups (a plain c // n would give each 0: no step
    would ever be filled)."""
    for mode, k, n, expected in [("sync", 0, 8, [1, 1, 1, 1, 0, 0, 0, 0]), ("off_policy", 1, 3, [3, 3, 2]),
                                 ("sync", 0, 2, [2, 2]), ("off_policy", 2, 5, [3, 3, 2, 2, 2])]:
        granted = []
        for rank in range(n):
            ctrl = AdmissionController.for_mode(mode, max_staleness=k, groups_per_step=4)
            ctrl.resync(trainer_version=0, backlog=0, explorers=n, rank=rank)
            granted.append(ctrl.admit(100))
        assert granted == expected and sum(granted) == (k + 1) * 4, (mode, n, granted)
    ctrl = AdmissionController.for_mode("sync", max_staleness=0, groups_per_step=4)
    ctrl.resync(trainer_version=0, backlog=6, explorers=4, rank=0)  # more produced than the version allows
    assert ctrl.capacity() == -1 and ctrl.admit(5) == 0
    with pytest.raises(ValueError, match="0 <= rank < explorers"):
        ctrl.resync(trainer_version=0, backlog=0, explorers=2, rank=2)


def test_modes_set_the_bound():
    assert [staleness_bound(m, 3) for m in ("sync", "off_policy", "async", "explore", "train", "offline")] == \
        [0, 3, None, None, None, None]
    assert AdmissionController.for_mode("sync", max_staleness=5, groups_per_step=2).capacity() == 2
    unbounded = AdmissionController.for_mode("async", max_staleness=0, groups_per_step=2, max_running=7)
    assert unbounded.reserve(100) == 7 and unbounded.capacity() == 0
    with pytest.raises(ValueError, match="run.mode: unknown mode 'offpolicy'"):
        staleness_bound("offpolicy", 1)


def test_async_flow_control_holds_admission_but_not_the_trainer():
    """async with run.async_max_staleness L: explorers wait at (L + version + 1) * B, like off_policy k = L, while the
    trainer's bound stays none (it keeps late samples); null: no wait at all; other modes ignore L."""
    assert [admission_bound(m, 1, 3) for m in ("sync", "off_policy", "async", "explore", "train", "offline")] == \
        [0, 1, 3, None, None, None]
    assert admission_bound("async", 1, None) is None and staleness_bound("async", 1) is None
    ctrl = AdmissionController.for_mode("async", max_staleness=0, async_max_staleness=2, groups_per_step=4)
    assert ctrl.admit(100) == 12  # (2 + 0 + 1) * 4
    ctrl.finish(12)
    ctrl.set_version(1)
    assert ctrl.admit(100) == 4  # one version more: one step's groups more
    assert StalenessTracker(mode="async", max_staleness=0).bound is None  # the trainer drops nothing for staleness
    with pytest.raises(ValueError, match="run.async_max_staleness: must be >= 0 or null, got -1"):
        admission_bound("async", 1, -1)


def test_controller_refuses_impossible_updates():
    ctrl = AdmissionController(groups_per_step=2, max_staleness=0, version=3)
    ctrl.reserve(1)
    with pytest.raises(ValueError, match=r"finish\(2\) with 1 groups running"):
        ctrl.finish(2)
    with pytest.raises(ValueError, match="version 2 is older than the current 3"):
        ctrl.set_version(2)
    with pytest.raises(ValueError, match="run.groups_per_step: must be >= 1"):
        AdmissionController(groups_per_step=0, max_staleness=1)


def group(policy_version: int, n_samples: int = 3) -> ExperienceGroup:
    samples = [Sample(sample_index=i, prompt_tokens=np.arange(3), response_tokens=np.arange(2),
                      logprobs=np.zeros(2, np.float32), loss_mask=np.ones(2, np.uint8), reward=0.0)
               for i in range(n_samples)]
    return ExperienceGroup(run_id="r", task_id=f"t{policy_version}", group_id=f"r/t{policy_version}/e0", attempt=0,
                           explorer_id="e", policy_version=policy_version, samples=samples)


def test_tracker_decides_and_reports_per_step():
    tracker = StalenessTracker(mode="off_policy", max_staleness=1)
    # step 3 -> staleness (3 - 1) - v: versions 2, 1, 1, 0, 3 -> 0, 1, 1, 2, -1
    reasons = [tracker.check(group(v), 3) for v in (2, 1, 1, 0, 3)]
    assert reasons == [None, None, None, "stale", "future_version"]
    assert tracker.check(group(2), 3) is None  # asked again (a held group): a check counts no use
    for v in (2, 1, 1):  # what the step trains is counted once, by `used`
        tracker.used(step=3, policy_version=v, n_samples=3)
    assert tracker.step_metrics(3) == {"staleness_mean": (0 * 3 + 1 * 6) / 9, "staleness_max": 1,
                                       "staleness_hist": {0: 3, 1: 6}, "dropped_stale": 3, "dropped_future": 3}
    assert tracker.step_metrics(3)["staleness_hist"] == {}  # popped


def test_sync_drops_anything_stale_and_async_keeps_everything():
    sync = StalenessTracker(mode="sync", max_staleness=4)
    assert [sync.observe(step=5, policy_version=v, n_samples=1) for v in (4, 3)] == [True, False]
    assert sync.step_metrics(5)["dropped_stale"] == 1
    unbounded = StalenessTracker(mode="async", max_staleness=0)
    assert all(unbounded.observe(step=5, policy_version=v, n_samples=1) for v in (4, 0, 9))
    assert unbounded.step_metrics(5)["staleness_hist"] == {-5: 1, 0: 1, 4: 1}


# ------------------------------------------------------------------------------------------------- simulation


@dataclass
class Simulation:
    """Explorers admit rollouts through the controller; finished groups go to a topic (a list, in arrival order);
    the trainer takes B groups per step through the tracker, trains for `train_ticks`, then publishes weights
    that reach the explorers `sync_ticks` later, with a resync from (version, backlog) as a coordinator would."""
    mode: str
    k: int
    duration: callable  # rng -> ticks a rollout takes
    groups_per_step: int = 4
    steps: int = 15
    max_running: int = 6
    train_ticks: int = 3
    sync_ticks: int = 1
    fail_rate: float = 0.0
    admission: bool = True
    explorer_restart_at: int | None = None
    seed: int = 0
    drop_rate: float = 0.0  # the share of groups the trainer's operators drop (they take no slot)
    counts_drops: bool = False  # admission counts on the trainer's keep fraction (over its last 4 steps)
    metrics: list[dict] = field(default_factory=list)

    def run(self) -> Simulation:
        self.rng, self.tracker = random.Random(self.seed), StalenessTracker(mode=self.mode, max_staleness=self.k)
        self.ctrl, self.explorer_version = self._controller(version=0), 0
        self.running, self.topic = [], []  # running: (finish tick, policy version); topic: policy versions
        self.read, self.committed = 0, {0: 0}  # trainer's topic position; its position at the end of each step
        self.arrivals, self.step, self.taken, self.train_done = {}, 1, 0, None
        self.kept, self.waited = [[0, 0]], 0  # per step [kept, dropped by operators]; trainer ticks without data
        for tick in range(5000):
            if tick in self.arrivals:
                self._load_weights(self.arrivals.pop(tick))
            if tick == self.explorer_restart_at:  # a new fleet: rollouts in flight are lost
                self.running, self.ctrl = [], self._controller(version=self.explorer_version)
                self._load_weights(self.explorer_version)
            self._explore(tick)
            self._train(tick)
            if len(self.metrics) == self.steps:
                return self
        raise AssertionError(f"deadlock: {len(self.metrics)}/{self.steps} steps in 5000 ticks")

    def _load_weights(self, version: int) -> None:
        self.explorer_version = version
        self.ctrl.set_version(version)
        self._announce(version, backlog=len(self.topic) - self.committed[version])

    def _announce(self, version: int, *, backlog: int, in_batch: int = 0) -> None:
        """The trainer's reading, with its keep fraction over its last 4 finished steps."""
        recent = self.kept[-5:-1]
        kept, seen = sum(k for k, _ in recent), sum(k + d for k, d in recent)
        self.feed.publish(trainer_version=version, backlog=backlog, in_batch=in_batch,
                          keep=kept / seen if seen else 1.0)

    def _explore(self, tick: int) -> None:
        admitted = self.ctrl.reserve(self.max_running)
        self.running += [(tick + self.duration(self.rng), self.explorer_version) for _ in range(admitted)]
        for rollout in [r for r in self.running if r[0] == tick]:
            self.running.remove(rollout)
            if self.rng.random() < self.fail_rate:
                self.ctrl.fail()
            else:
                self.topic.append(rollout[1])
                self.ctrl.finish()

    def _train(self, tick: int) -> None:
        if self.train_done is None:
            while self.taken < self.groups_per_step and self.read < len(self.topic):
                if self.rng.random() < self.drop_rate:
                    self.kept[-1][1] += 1
                else:
                    kept = self.tracker.observe(step=self.step, policy_version=self.topic[self.read], n_samples=1)
                    self.taken += kept
                    self.kept[-1][0] += kept
                self.read += 1
            if self.taken == self.groups_per_step:
                self.train_done = tick + self.train_ticks
            else:  # starved: it says what it has consumed and taken (trainer_waiting)
                self.waited += 1
                if self.drop_rate:
                    self._announce(self.step - 1, backlog=len(self.topic) - self.read, in_batch=self.taken)
        elif tick == self.train_done:  # step done: version `step` exists and is published
            self.committed[self.step] = self.read
            self.arrivals[tick + self.sync_ticks] = self.step
            self.metrics.append(self.tracker.step_metrics(self.step))
            self.step, self.taken, self.train_done = self.step + 1, 0, None
            self.kept.append([0, 0])

    def _controller(self, version: int) -> AdmissionController:
        self.feed = InMemoryFeed()
        if not self.admission:
            return AdmissionController(groups_per_step=self.groups_per_step, max_staleness=None,
                                       max_running=self.max_running, version=version, feed=self.feed, refresh_s=0)
        return AdmissionController.for_mode(self.mode, max_staleness=self.k, groups_per_step=self.groups_per_step,
                                            max_running=self.max_running, version=version, feed=self.feed,
                                            refresh_s=0, counts_drops=self.counts_drops)

    @property
    def used(self) -> dict[int, int]:
        """Samples used in training, by staleness, over the whole run."""
        total: dict[int, int] = {}
        for m in self.metrics:
            for s, n in m["staleness_hist"].items():
                total[s] = total.get(s, 0) + n
        return total

    @property
    def dropped(self) -> int:
        return sum(m["dropped_stale"] + m["dropped_future"] for m in self.metrics)


def constant(ticks):
    return lambda rng: ticks


def uniform(low, high):
    return lambda rng: rng.randint(low, high)


@pytest.mark.parametrize("mode, k", [("sync", 0), ("off_policy", 1), ("off_policy", 3)])
def test_admission_alone_keeps_every_sample_within_k_when_rollouts_finish_in_order(mode, k):
    sim = Simulation(mode=mode, k=k, duration=constant(2), max_running=64).run()
    assert len(sim.metrics) == sim.steps and sim.dropped == 0
    assert max(sim.used) == k, "fast explorers run ahead exactly as far as the bound allows"
    assert sum(sim.used.values()) == sim.steps * sim.groups_per_step


@pytest.mark.parametrize("seed", range(3))
def test_with_stragglers_the_tracker_drops_the_few_beyond_k(seed):
    k = 1
    with_admission = Simulation(mode="off_policy", k=k, duration=uniform(1, 9), fail_rate=0.1, seed=seed).run()
    assert max(with_admission.used) <= k and min(with_admission.used) >= 0
    without = Simulation(mode="off_policy", k=k, duration=uniform(1, 9), fail_rate=0.1, seed=seed,
                         admission=False, max_running=32).run()
    assert max(without.used) <= k  # the tracker still enforces the bound ...
    assert without.dropped > 3 * max(1, with_admission.dropped)  # ... but only admission avoids throwing work away


def test_an_explorer_restart_rebuilds_the_controller_from_version_and_backlog():
    sim = Simulation(mode="off_policy", k=2, duration=constant(2), max_running=64, explorer_restart_at=20).run()
    assert len(sim.metrics) == sim.steps and sim.dropped == 0 and max(sim.used) <= 2


def test_async_is_unbounded_but_recorded():
    sim = Simulation(mode="async", k=0, duration=constant(1), max_running=64).run()
    assert sim.dropped == 0 and max(sim.used) > 3


def test_counting_drops_fills_the_slots_left_by_the_keep_fraction():
    """slots = (k + v + 1) * B - (accepted_fleet - backlog) are filled by floor(slots / keep) groups, less the
    backlog made already; keep 1 is the plain formula."""
    # k 1, version 2, B 4; trained 2 * 4 + 1 in the batch, 3 in the backlog: accepted_fleet 12, slots 16 - 9 = 7
    assert fleet_capacity(1, 2, 4, 12, backlog=3) == 4 == fleet_capacity(1, 2, 4, 12, backlog=3, keep=1.0)
    assert fleet_capacity(1, 2, 4, 12, backlog=3, keep=0.5) == 14 - 3
    assert fleet_capacity(1, 2, 4, 12, backlog=3, keep=0.3) == 23 - 3  # floor(7 / 0.3)
    assert fleet_capacity(1, 2, 4, 18, backlog=9, keep=0.5) == 14 - 9  # 9 trained, 9 made: 5 more
    assert fleet_capacity(1, 2, 4, 18, backlog=1, keep=0.5) == -2  # no slot left (-1): nothing, and no amplification
    ctrl = AdmissionController(groups_per_step=4, max_staleness=1, counts_drops=True, feed=InMemoryFeed(),
                               refresh_s=0)
    ctrl.feed.publish(trainer_version=2, backlog=3, keep=0.5)
    ctrl.set_version(2)
    assert ctrl.reserve(100) == math.floor(8 / (0.5 + KEEP_MARGIN)) - 3  # slots 16 - 2 * 4 = 8; 3 made
    admitted = ctrl.state().running
    ctrl.feed.publish(trainer_version=2, backlog=3, keep=-1.0)  # clamped to KEEP_FLOOR
    assert ctrl.reserve(100) == math.floor(8 / KEEP_FLOOR) - 3 - admitted
    plain = AdmissionController(groups_per_step=4, max_staleness=1, feed=InMemoryFeed(), refresh_s=0)
    plain.feed.publish(trainer_version=2, backlog=3, keep=0.5)  # the option off: the reading's keep is ignored
    plain.set_version(2)
    assert plain.reserve(100) == 16 - 11


@pytest.mark.parametrize("seed", range(3))
def test_counting_drops_keeps_the_trainer_fed_and_the_bound_held(seed):
    """The trainer's operators drop half the groups. Counting each admitted group as a slot, the trainer waits for
    the replacements of what it dropped; counting on its keep fraction, it waits ~half as long, every sample
    it trains is still within k (the tracker drops the few past it), and little work is thrown away (KEEP_MARGIN's
    reason)."""
    runs = {counts: Simulation(mode="off_policy", k=1, duration=uniform(1, 3), drop_rate=0.5, counts_drops=counts,
                               max_running=64, steps=30, seed=seed).run() for counts in (False, True)}
    plain, counting = runs[False], runs[True]
    assert plain.dropped == 0 and max(plain.used) <= 1
    assert max(counting.used) <= 1 and min(counting.used) >= 0
    assert counting.waited < 0.6 * plain.waited, (counting.waited, plain.waited)
    assert counting.dropped <= 0.1 * sum(counting.used.values()), counting.dropped

