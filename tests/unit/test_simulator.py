"""The fleet simulator (benchmarks/simulate.py) on cases with known answers: one explorer in sync mode, a trainer-bound
and a generation-bound overlapped run, members beyond the partition count, the staleness bound, rebalances and
weight-store contention, and the admission ledger keeping a fleet within the bound."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from benchmarks.simulate import MODES, Simulation, Stages, bounds, main, simulate
from rft.explorer.admission import StalenessAdmission

REPO = Path(__file__).resolve().parents[2]
FREE = Stages(gen_group_s=1.0, tasks_per_batch=4, samples_per_group=8, groups_per_step=16, train_s=4.0,
              publish_s=0.0, notice_s=0.0, reload_s=0.0, weights_gb=0.0, rebalance_s=0.0)


def test_one_explorer_in_sync_mode_alternates_generation_and_training():
    result = simulate(FREE, explorers=1, partitions=4, mode="sync", steps=10)
    step_s = 16 * 1.0 + 4.0  # generate the step's 16 groups, then train on them: nothing overlaps
    assert result.samples_per_s == pytest.approx(16 * 8 / step_s)
    assert result.samples_per_s == pytest.approx(bounds(FREE, 1)["sync"])
    assert result.staleness == {0: 10 * 16 * 8} and result.dropped_stale == 0
    assert result.trainer_idle == pytest.approx(16 / 20, rel=0.02)  # waits for all but the first step's training


def test_a_trainer_bound_async_run_steps_at_the_trainers_rate():
    stages = dataclasses.replace(FREE, gen_group_s=0.05, publish_s=0.5)
    result = simulate(stages, explorers=4, partitions=4, mode="async", steps=20)
    assert result.samples_per_s == pytest.approx(16 * 8 / (4.0 + 0.5))
    assert result.trainer_idle < 0.01


def test_a_generation_bound_overlapped_run_is_the_fleets_generation_rate():
    stages = dataclasses.replace(FREE, train_s=0.01)
    for n in (1, 2, 4):
        result = simulate(stages, explorers=n, partitions=4, mode="async", steps=20)
        assert result.samples_per_s == pytest.approx(n * 8 / 1.0, rel=0.01)
        assert result.explorer_idle < 0.01


def test_members_beyond_the_partition_count_sit_idle():
    stages = dataclasses.replace(FREE, train_s=0.01)  # generation-bound: more explorers would help
    four = simulate(stages, explorers=4, partitions=4, mode="async", steps=10)
    eight = simulate(stages, explorers=8, partitions=4, mode="async", steps=10)
    assert (eight.active, eight.samples_per_s) == (4, four.samples_per_s)
    assert simulate(stages, explorers=8, partitions=8, mode="async", steps=10).samples_per_s == pytest.approx(
        2 * four.samples_per_s, rel=0.01)


@pytest.mark.parametrize("mode, k", [("sync", 0), ("off_policy k=1", 1), ("off_policy k=2", 2)])
def test_admission_keeps_staleness_within_k(mode, k):
    result = simulate(dataclasses.replace(FREE, gen_group_s=0.2), explorers=8, partitions=8, mode=mode, steps=15)
    assert max(result.staleness) <= k and result.dropped_stale == 0
    assert max(simulate(dataclasses.replace(FREE, gen_group_s=0.2), explorers=8, partitions=8, mode="async",
                        steps=15).staleness) > 2  # unbounded: the fleet runs ahead


def test_rebalances_and_store_contention_cost_throughput():
    base = simulate(FREE, explorers=4, partitions=4, mode="async", steps=10).samples_per_s
    churn = simulate(dataclasses.replace(FREE, churn_per_min=6, rebalance_s=5.0), explorers=4, partitions=4,
                     mode="async", steps=10).samples_per_s
    assert churn < 0.9 * base
    pulls = dataclasses.replace(FREE, train_s=0.01, weights_gb=1.0, store_gbps=1.0, client_gbps=1.0)
    one = simulate(pulls, explorers=1, partitions=64, mode="async", steps=20).samples_per_s
    many = simulate(pulls, explorers=64, partitions=64, mode="async", steps=20).samples_per_s
    assert many < 64 * one * 0.8  # 64 explorers pulling each version through one store do not scale linearly


def test_the_command_line_rejects_an_unknown_stage_field(capsys):
    assert main(["--set", "train_seconds=3"]) == 2
    assert "unknown stage field(s) train_seconds" in capsys.readouterr().err
    assert main(["--explorers", "1", "--modes", "sync", "--steps", "3", "--json"]) == 0
    assert '"efficiency"' in capsys.readouterr().out


def test_shared_cores_slow_every_job_that_overlaps():
    """Processor sharing: in async mode one explorer never idles, so on one core the trainer's every step runs
    at half speed (known answer 2 x train_s per step); on two cores nothing slows. A generation-bound fleet of 4
    explorers on 2 cores generates at 2 explorers' rate."""
    stages = dataclasses.replace(FREE, gen_group_s=0.1, train_s=4.0)
    alone = simulate(stages, explorers=1, partitions=4, mode="async", steps=20)
    assert alone.samples_per_s == pytest.approx(16 * 8 / 4.0, rel=0.01)
    assert simulate(dataclasses.replace(stages, cores=2), explorers=1, partitions=4, mode="async",
                    steps=20).samples_per_s == pytest.approx(alone.samples_per_s, rel=0.01)
    one_core = simulate(dataclasses.replace(stages, cores=1), explorers=1, partitions=4, mode="async", steps=20)
    assert one_core.samples_per_s == pytest.approx(16 * 8 / (2 * 4.0), rel=0.01)
    fleet = simulate(dataclasses.replace(FREE, train_s=0.001, cores=2), explorers=4, partitions=4, mode="async",
                     steps=20)
    assert fleet.samples_per_s == pytest.approx(2 * 8 / 1.0, rel=0.02)


def test_a_fleet_larger_than_a_step_still_fills_every_sync_step():
    """8 explorers, 4 groups a step, sync: the production admission's shares give ranks 0-3 one group each (a plain
    capacity // explorers would give every member 0), generated side by side: a step is one group's generation
    then the training, 4 x 8 samples per (1 + 4) s."""
    stages = dataclasses.replace(FREE, groups_per_step=4)
    result = simulate(stages, explorers=8, partitions=8, mode="sync", steps=10)
    assert result.samples_per_s == pytest.approx(4 * 8 / (1.0 + 4.0))
    assert set(result.staleness) == {0} and result.dropped_stale == 0


@pytest.mark.parametrize("k, version, trained_steps, backlog, explorers, rank, running", [
    (0, 0, 0, 0, 1, 0, 0), (1, 2, 2, 5, 3, 1, 3), (2, 1, 3, 2, 4, 3, 1), (1, 0, 0, 40, 2, 0, 0)])
def test_the_simulators_admission_is_productions(k, version, trained_steps, backlog, explorers, rank, running):
    """The same fleet state gives the simulator's explorer and a StalenessAdmission the same capacity."""
    sim = Simulation(FREE, explorers=explorers, partitions=explorers, k=k, steps=10)
    sim.loaded[rank], sim.trained, sim.running_at[rank] = version, trained_steps * 16, running
    sim.topic.extend([0] * backlog)
    production = StalenessAdmission(groups_per_step=16, max_staleness=k)
    production.resync(trainer_version=trained_steps, backlog=backlog, explorers=explorers, rank=rank)
    production.set_version(version)
    assert production.admit(running) == running
    assert sim._capacity(rank) == production.capacity()


def test_the_benchmark_modes_take_their_bounds_from_rft_modes():
    assert MODES == {"sync": 0, "off_policy k=1": 1, "off_policy k=2": 2, "async": float("inf")}


class WithoutLedger(Simulation):
    """The simulator's explorers as they admitted before the ledger (issue 28): each starts what the formula gives it,
    without counting the groups the others are running."""

    def _admit(self, e: int) -> int:
        return max(0, int(min(self.s.tasks_per_batch, self._capacity(e))))


@pytest.mark.parametrize("mode", ["sync", "off_policy k=1"])
def test_the_ledger_keeps_a_fleet_of_three_within_the_bound(mode):
    """The flagship's stage times on 2 shared cores (configs/stages-smollm2.json), 3 explorers: admitting through
    production's ledger drops nothing as stale; the same fleet admitting as before the ledger overshoots."""
    stages = dataclasses.replace(Stages(**json.loads((REPO / "configs" / "stages-smollm2.json").read_text())),
                                 cores=2.0)
    ledger = Simulation(stages, explorers=3, partitions=4, k=MODES[mode], steps=40, mode=mode).run()
    before = WithoutLedger(stages, explorers=3, partitions=4, k=MODES[mode], steps=40, mode=mode).run()
    assert ledger.dropped_stale == 0 and max(ledger.staleness) <= MODES[mode]
    assert before.dropped_stale > 0
    assert ledger.samples_per_s > 0.8 * before.samples_per_s  # the groups dropped before were wasted work
