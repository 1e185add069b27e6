"""`rft bench simulate`: an event model of an rft run, to predict fleets far larger than this machine holds.

The model (deterministic, one event queue, times in seconds):
- **Explorers** (`explorers`), of which at most `partitions` are active: a consumer group gives each tasks partition to
  one member, so members beyond the partition count hold nothing and sit idle. An active explorer loops: ask the
  admission bound for up to `tasks_per_batch` groups; generate them (`batch_s(n)` = `gen_overhead_s` + n x
  `gen_group_s`); produce them to the experiences topic stamped with the weights version it holds; if a newer
  version was announced, reload it (below) before the next batch. Refused by admission, it waits for the next
  announcement and notices it after `notice_s` (polling: half the poll interval on average; 0 when announcements
  wake it).
- **Admission**: production's rule itself (rft/explorer/admission.py): each explorer asks for what production's
  formula gives it (`capacity`: its share by rank of the bound, with v the version explorer e holds, k
  `max_staleness`: 0 in sync, unbounded in async, the fleet's accepted groups = trained + backlog, less the groups it
  runs), and claims them through production's `AdmissionLedger`, which grants what the fleet's outstanding groups
  leave (the simulator's event order is the log: a claim is read back at once, a batch's groups are released when
  they are produced), so the fleet never starts more than the bound.
- **Trainer**: takes `groups_per_step` groups in arrival order once that many are on the topic; a step costs
  `train_s`, then `publish_s` on its critical path (the weights handed to the writer); the version is announced
  then. A group older than k versions at its step is dropped as stale (counted), as the trainer does.
- **Weight pulls** contend on the store: a reload costs `weights_gb` / (the store's `store_gbps` shared by the
  pulls in flight when it starts, capped at `client_gbps` per client), then `reload_s` of compute (the engine
  loading them).
- **Rebalances**: every join or leave (`churn_per_min` of them, evenly spaced) pauses admission fleet-wide for
  `rebalance_s`: no member starts a batch while the group rebalances.
- **Shared cores** (`cores`, default unbounded: every part on its own hardware, as on a GPU cluster): a batch's
  generation, an engine reload and a trainer step are compute jobs; while more jobs run than there are cores,
  each progresses at `cores / jobs` of its full speed (processor sharing). On the 2-core CPU an explorer and the
  trainer each take one core (`rft bench modes --threads 1`), so a second explorer slows everything that overlaps
  it. Stage times are each part's time with a core to itself.

It reports what `rft bench modes` measures: samples/s over the steady state (from the end of the first tenth of
the steps, at least step 1, to the end of the last step), the trainer's idle fraction, the active explorers' idle
fraction, idle members, the staleness histogram and the groups dropped as stale. Stage times come from measured
runs (`--stage-times FILE`, JSON with the `Stages` fields; see docs/scaling.md for where each number comes from).
"""
from __future__ import annotations

import argparse
import dataclasses
import heapq
import json
import math
import sys
from collections import Counter, deque
from dataclasses import dataclass, field
from pathlib import Path

from rft.explorer.admission import AdmissionLedger, capacity, fleet_capacity
from rft.modes import staleness_bound
from rft.transport.control import AdmissionClaim, AdmissionRelease

# The runs `rft bench modes` and `rft bench simulate` compare: label -> (run.mode, run.max_staleness), async with
# run.async_max_staleness null (no flow control). What each mode means (its bounds) is rft.modes', the one table.
BENCH_MODES = {"sync": ("sync", 0), "off_policy k=1": ("off_policy", 1), "off_policy k=2": ("off_policy", 2),
               "async": ("async", 0)}


def bound_of(label: str) -> float:
    """The staleness bound k of the benchmark mode `label`, as rft.modes defines it (math.inf: none)."""
    k = staleness_bound(*BENCH_MODES[label])
    return math.inf if k is None else k


MODES = {label: bound_of(label) for label in BENCH_MODES}  # label -> k, what the simulator takes


@dataclass(frozen=True)
class Stages:
    """What one run is made of. Seconds unless named otherwise."""
    gen_group_s: float = 1.0  # one explorer's generation + scoring time per group, at full batch
    gen_overhead_s: float = 0.0  # per batch, whatever its size
    tasks_per_batch: int = 4
    samples_per_group: int = 8
    groups_per_step: int = 16
    train_s: float = 4.0  # one trainer step on groups_per_step groups
    publish_s: float = 0.1  # the trainer's critical-path cost of handing a version to the writer
    notice_s: float = 0.0  # from announcement to an idle explorer acting on it
    reload_s: float = 0.4  # an explorer's engine reload, store reads excluded
    weights_gb: float = 0.27  # one version's size
    store_gbps: float = 2.0  # the weight store's bandwidth, shared by concurrent pulls
    client_gbps: float = 1.0  # one explorer's read bandwidth
    rebalance_s: float = 3.0  # admission pause of one consumer-group rebalance
    churn_per_min: float = 0.0  # joins + leaves per minute
    cores: float = math.inf  # compute cores shared by the explorers' generation and the trainer's steps

    def batch_s(self, groups: int) -> float:
        return self.gen_overhead_s + groups * self.gen_group_s


@dataclass
class Result:
    mode: str
    explorers: int
    active: int
    samples_per_s: float
    trainer_idle: float
    explorer_idle: float
    staleness: dict[int, int]
    dropped_stale: int
    seconds: float

    def row(self) -> dict:
        return {**dataclasses.asdict(self), "staleness": {str(k): v for k, v in sorted(self.staleness.items())}}


@dataclass(order=True)
class _Event:
    time: float
    order: int
    kind: str = field(compare=False)
    who: int = field(compare=False, default=-1)
    data: object = field(compare=False, default=None)


class Simulation:
    """One run: `explorers` members, `partitions` tasks partitions, max staleness `k` (math.inf: async), until the
    trainer has taken `steps` steps. `run()` returns the Result."""

    def __init__(self, stages: Stages, *, explorers: int, partitions: int, k: float, steps: int, mode: str = ""):
        if explorers < 1 or partitions < 1 or steps < 2:
            raise ValueError(f"need explorers >= 1, partitions >= 1, steps >= 2; "
                             f"got {explorers}, {partitions}, {steps}")
        self.s, self.k, self.steps, self.mode = stages, k, steps, mode
        self.explorers, self.active = explorers, min(explorers, partitions)
        self._queue: list[_Event] = []
        self._order = 0
        self.now = 0.0
        self.version = 0  # newest announced
        self.loaded = [0] * self.active
        self.busy_s = [0.0] * self.active  # generating
        self.running_at = [0] * self.active  # groups each explorer is generating
        self.waiting: set[int] = set()  # refused by admission or paused: woken by the next announcement / resume
        self.topic: deque[int] = deque()  # policy versions of the groups produced and not yet taken
        self.trained = 0  # groups taken by the trainer (trained or dropped)
        self.training = False
        self.jobs: dict[int, tuple] = {}  # compute jobs running: id -> (started, kind, who, data)
        self._job_ends: list[tuple[float, int]] = []  # heap of (the service at which a job ends, id)
        self._service = 0.0  # seconds of full-speed work each running job has received since the start
        self._jobs_at = 0.0  # when `_service` was last brought up to date
        self._jobs_due = 0  # the id of the one pending `job_done` event that is still current
        self.trainer_wait_s = 0.0
        self.trainer_waiting_since: float | None = 0.0
        self.step_ends: list[float] = []
        self.staleness: Counter[int] = Counter()
        self.dropped = 0
        self.pulls_in_flight = 0
        self.paused_until = 0.0
        self.ledger = AdmissionLedger()  # the fleet's claims and releases, in event order (rft/explorer/admission.py)

    # events ------------------------------------------------------------------------------------------------------
    def _at(self, time: float, kind: str, who: int = -1, data: object = None) -> None:
        self._order += 1
        heapq.heappush(self._queue, _Event(time, self._order, kind, who, data))

    def run(self) -> Result:
        for e in range(self.active):
            self._at(0.0, "admit", e)
        if self.s.churn_per_min > 0:
            self._at(60.0 / self.s.churn_per_min, "rebalance")
        while self._queue and len(self.step_ends) < self.steps:
            event = heapq.heappop(self._queue)
            self.now = event.time
            getattr(self, f"_on_{event.kind}")(event)
        if len(self.step_ends) < self.steps:
            raise RuntimeError(f"the simulated run stalled after {len(self.step_ends)} of {self.steps} steps")
        warmup = max(1, self.steps // 10)
        start, end = self.step_ends[warmup - 1], self.step_ends[-1]
        steady = end - start
        samples = (self.steps - warmup) * self.s.groups_per_step * self.s.samples_per_group
        return Result(mode=self.mode, explorers=self.explorers, active=self.active,
                      samples_per_s=samples / steady, trainer_idle=self.trainer_wait_s / end,
                      explorer_idle=1 - sum(self.busy_s) / (self.active * end), staleness=dict(self.staleness),
                      dropped_stale=self.dropped, seconds=end)

    # compute jobs (processor sharing over `cores`) --------------------------------------------------------------
    # Every job runs at the same speed, so one counter, the service each job has received since the start
    # (`_service`), tells them all apart: a job ends when the counter reaches its start value plus its work.
    def _speed(self) -> float:
        return min(1.0, self.s.cores / len(self.jobs)) if self.jobs else 1.0

    def _bring_jobs_up_to_date(self) -> None:
        self._service += (self.now - self._jobs_at) * self._speed()
        self._jobs_at = self.now

    def _schedule_next_job_end(self) -> None:
        self._jobs_due += 1
        if self.jobs:
            left = self._job_ends[0][0] - self._service
            self._at(self.now + max(left, 0.0) / self._speed(), "job_done", data=self._jobs_due)

    def _start_job(self, work: float, kind: str, who: int = -1, data: object = None) -> None:
        if math.isinf(self.s.cores):  # nothing is shared: the job ends `work` from now (and the big fleets run fast)
            self._at(self.now + work, kind, who, (self.now, data))
            return
        self._bring_jobs_up_to_date()
        self._order += 1
        self.jobs[self._order] = (self.now, kind, who, data)
        heapq.heappush(self._job_ends, (self._service + work, self._order))
        self._schedule_next_job_end()

    def _on_job_done(self, event: _Event) -> None:
        if event.data != self._jobs_due:  # superseded: the set of jobs changed since it was scheduled
            return
        self._bring_jobs_up_to_date()
        ended = []
        while self._job_ends and self._job_ends[0][0] <= self._service + 1e-9:
            ended.append(self.jobs.pop(heapq.heappop(self._job_ends)[1]))
        self._schedule_next_job_end()
        for started, kind, who, data in ended:
            getattr(self, f"_on_{kind}")(_Event(self.now, 0, kind, who, (started, data)))

    # explorers ---------------------------------------------------------------------------------------------------
    def _capacity(self, e: int) -> float:
        """What explorer e asks for: production's formula (rft/explorer/admission.py `capacity`: its share of the
        bound less what it runs)."""
        if math.isinf(self.k):
            return self.s.tasks_per_batch
        return capacity(int(self.k), self.loaded[e], self.s.groups_per_step, self.trained + len(self.topic),
                        explorers=self.active, rank=e, here=self.running_at[e])

    def _admit(self, e: int) -> int:
        """Groups explorer e starts now: what it asks for (`_capacity`), as far as the fleet's outstanding groups
        leave room, claimed through production's ledger (rft/explorer/admission.py)."""
        wanted = int(min(self.s.tasks_per_batch, self._capacity(e)))
        if wanted < 1 or math.isinf(self.k):
            return max(wanted, 0)
        limit = fleet_capacity(int(self.k), self.loaded[e], self.s.groups_per_step, self.trained + len(self.topic))
        seen = self.ledger.position
        return self.ledger.apply(seen, AdmissionClaim(explorer_id=str(e), claim_id=str(seen), groups=wanted,
                                                      limit=limit, seen=seen))

    def _on_admit(self, event: _Event) -> None:
        e = event.who
        if self.now < self.paused_until:
            self.waiting.add(e)
            return
        n = self._admit(e)
        if n < 1:
            self.waiting.add(e)
            return
        self.running_at[e] += n
        self._start_job(self.s.batch_s(n), "produced", e, (n, self.loaded[e]))

    def _on_produced(self, event: _Event) -> None:
        started, (n, version) = event.data
        e = event.who
        self.busy_s[e] += self.now - started
        self.running_at[e] -= n
        self.topic.extend([version] * n)
        if not math.isinf(self.k):
            self.ledger.apply(self.ledger.position, AdmissionRelease(explorer_id=str(e), groups=n))
        self._try_step()
        self._next_batch(e)

    def _next_batch(self, e: int) -> None:
        if self.loaded[e] < self.version:
            self.pulls_in_flight += 1
            bandwidth = min(self.s.client_gbps, self.s.store_gbps / self.pulls_in_flight)
            self._at(self.now + self.s.weights_gb / bandwidth, "pulled", e, self.version)
        else:
            self._at(self.now, "admit", e)

    def _on_pulled(self, event: _Event) -> None:
        """The version's bytes are here; loading them into the engine is compute (`reload_s`)."""
        self.pulls_in_flight -= 1
        self._start_job(self.s.reload_s, "reloaded", event.who, event.data)

    def _on_reloaded(self, event: _Event) -> None:
        _, version = event.data
        self.loaded[event.who] = version
        self._next_batch(event.who)

    # the trainer ---------------------------------------------------------------------------------------------------
    def _try_step(self) -> None:
        if self.training or self.trainer_waiting_since is None:
            return
        if len(self.topic) < self.s.groups_per_step:
            return
        self.trainer_wait_s += self.now - self.trainer_waiting_since
        self.trainer_waiting_since = None
        step = len(self.step_ends)  # the trainer holds version `step` and trains step + 1
        for _ in range(self.s.groups_per_step):
            staleness = step - self.topic.popleft()
            self.trained += 1
            if staleness > self.k:
                self.dropped += 1
            else:
                self.staleness[staleness] += self.s.samples_per_group
        self.training = True
        self._start_job(self.s.train_s + self.s.publish_s, "step_done")

    def _on_step_done(self, event: _Event) -> None:
        self.training = False
        self.step_ends.append(self.now)
        self.version += 1
        woken, self.waiting = self.waiting, set()
        for e in sorted(woken):
            self._at(self.now + self.s.notice_s, "wake", e)
        self.trainer_waiting_since = self.now
        self._try_step()

    def _on_wake(self, event: _Event) -> None:
        self._next_batch(event.who)

    def _on_rebalance(self, event: _Event) -> None:
        self.paused_until = max(self.paused_until, self.now + self.s.rebalance_s)
        self._at(self.paused_until, "resume")
        self._at(self.now + 60.0 / self.s.churn_per_min, "rebalance")

    def _on_resume(self, event: _Event) -> None:
        if self.now < self.paused_until:
            return
        woken, self.waiting = self.waiting, set()
        for e in sorted(woken):
            self._at(self.now, "admit", e)


def simulate(stages: Stages, *, explorers: int, partitions: int, mode: str, steps: int = 40) -> Result:
    """One simulated run of at least `steps` steps, and enough for every active explorer to generate about ten
    batches (a large fleet's first batches alone would fill many steps)."""
    active = min(explorers, partitions)
    steps = max(steps, math.ceil(10 * active * stages.tasks_per_batch / stages.groups_per_step))
    return Simulation(stages, explorers=explorers, partitions=partitions, k=MODES[mode], steps=steps,
                      mode=mode).run()


def bounds(stages: Stages, active: int) -> dict[str, float]:
    """The physical bounds in samples/s (of `rft bench modes`): generation alone, training alone, sync
    `1 / (1/gen + 1/train)` and overlapped `min(gen, train)`."""
    per_group = stages.batch_s(stages.tasks_per_batch) / stages.tasks_per_batch
    gen = active * stages.samples_per_group / per_group
    train = stages.groups_per_step * stages.samples_per_group / (stages.train_s + stages.publish_s)
    return {"generation": gen, "training": train, "sync": 1 / (1 / gen + 1 / train), "overlapped": min(gen, train)}


FLEETS = [1, 2, 3, 4, 8, 16, 32, 64, 128, 256, 512, 1024]


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="rft bench simulate", description=__doc__.split("\n")[0])
    parser.add_argument("--stage-times", type=Path, help="JSON of Stages fields (defaults: see benchmarks/simulate.py)")
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE", help="override one stage field")
    parser.add_argument("--explorers", type=int, nargs="+", default=FLEETS)
    parser.add_argument("--partitions", type=int, nargs="+", default=[4])
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--plot", type=Path, help="write samples/s against fleet size (PNG)")
    args = parser.parse_args(argv)
    values = json.loads(args.stage_times.read_text()) if args.stage_times else {}
    for item in args.set:
        key, _, value = item.partition("=")
        values[key] = float(value)
    known = {f.name: f.type for f in dataclasses.fields(Stages)}
    unknown = sorted(set(values) - set(known))
    if unknown:
        print(f"rft bench simulate: unknown stage field(s) {', '.join(unknown)}; known: {', '.join(known)}",
              file=sys.stderr)
        return 2
    stages = Stages(**{k: int(v) if known[k] == "int" else float(v) for k, v in values.items()})
    rows = []
    for partitions in args.partitions:
        for n in args.explorers:
            for mode in args.modes:
                result = simulate(stages, explorers=n, partitions=partitions, mode=mode, steps=args.steps)
                bound = bounds(stages, result.active)["sync" if mode == "sync" else "overlapped"]
                rows.append({**result.row(), "partitions": partitions, "bound": bound,
                             "efficiency": result.samples_per_s / bound})
    if args.plot:
        plot(rows, args.plot)
    if args.json:
        print(json.dumps({"stages": dataclasses.asdict(stages), "rows": rows}, indent=1))
        return 0
    print(f"stages: {dataclasses.asdict(stages)}")
    print(f"{'partitions':>10} {'explorers':>9} {'active':>6} {'mode':<15} {'samples/s':>9} {'bound':>8} {'eff':>5} "
          f"{'trainer idle':>12} {'explorer idle':>13} {'dropped':>7}  staleness (versions)")
    for r in rows:
        print(f"{r['partitions']:>10} {r['explorers']:>9} {r['active']:>6} {r['mode']:<15} {r['samples_per_s']:>9.1f} "
              f"{r['bound']:>8.1f} {r['efficiency']:>5.2f} {r['trainer_idle']:>12.0%} {r['explorer_idle']:>13.0%} "
              f"{r['dropped_stale']:>7}  {staleness_summary(r['staleness'])}")
    return 0


def staleness_summary(histogram: dict[str, int]) -> str:
    """`max 3, mean 1.2` of a staleness histogram (staleness -> samples)."""
    total = sum(histogram.values())
    mean = sum(int(k) * v for k, v in histogram.items()) / total if total else 0.0
    return f"max {max(map(int, histogram), default=0)}, mean {mean:.1f}"


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib  # heavy: matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # heavy: matplotlib

    figure, axis = plt.subplots(figsize=(7, 4))
    for partitions in sorted({r["partitions"] for r in rows}):
        for mode in dict.fromkeys(r["mode"] for r in rows):
            points = [(r["explorers"], r["samples_per_s"]) for r in rows
                      if r["mode"] == mode and r["partitions"] == partitions]
            axis.plot(*zip(*points, strict=True), marker="o", label=f"{mode}, {partitions} partitions")
    axis.set_xscale("log", base=2)
    axis.set_xlabel("explorers")
    axis.set_ylabel("samples/s (simulated)")
    axis.grid(True, alpha=0.3)
    axis.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
