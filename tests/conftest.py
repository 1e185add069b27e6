"""Shared fixtures: a real local broker (Tansu over TCP), tiny HF models, a unique topic prefix."""
from __future__ import annotations

import itertools
import json
import os
import resource
import time
import uuid

import pytest

from rft.broker.local import LocalBroker
from rft.transport.config import KafkaConfig

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# The suite's runs share 2 cores two at a time (below) and train models of 0.3 M parameters, which one thread does as
# fast as two: one OpenMP thread per process (the runs' parts inherit it; rft run's split of the cores is
# tests/integration/test_launcher_parts.py's) measured the e2e tests 9% faster side by side than two spinning threads
# each.
os.environ.setdefault("OMP_NUM_THREADS", "1")

# The tests that keep more than one core busy for most of their time (a whole run, torchrun ranks: measured 1.1 to
# 1.4 cores on average, e.g. test_serve_run, test_trainer_dpo, test_slurm_launchers) or hold the session's one Slurm
# cluster: those marked e2e, distributed or slurm, which live in these directories (checked at collection).
HEAVY_MARKS = ("e2e", "distributed", "slurm")
HEAVY_DIRS = ("tests/e2e/", "tests/distributed/", "tests/slurm/")
# Of those, the ones whose checks do not depend on how fast they run (numbers against a reference, one Slurm job
# after another, the GPU check's rows, a one-rank trainer fed from records already on the broker): both workers take
# them at the end of the session, a file at a time (the Slurm directory as one unit: one cluster), so neither worker
# idles while the other finishes.
LATE = ("tests/distributed/", "tests/slurm/", "tests/e2e/test_gpu_check.py", "tests/e2e/test_trainer_operators.py",
        "tests/e2e/test_trainer_resume.py", "tests/e2e/test_replay_buffer_resume.py", "tests/e2e/test_replay.py",
        "tests/e2e/test_long_routing_records.py")  # record sizes and a trained step: 233 s, no timing in its checks


def pytest_collection_modifyitems(items):
    """A test marked e2e, distributed or slurm outside HEAVY_DIRS would run beside the heavy ones: refused."""
    stray = [i.nodeid for i in items
             if any(i.get_closest_marker(m) for m in HEAVY_MARKS) and not i.nodeid.startswith(HEAVY_DIRS)]
    if stray:
        raise pytest.UsageError(f"tests marked {'/'.join(HEAVY_MARKS)} must live in {', '.join(HEAVY_DIRS)} "
                                f"(tests/conftest.py runs those one at a time under xdist): {stray}")


# The tests that mostly wait (on timers, the broker's rebalances, a registry's downloads), measured well under half a
# core over their time (RFT_TEST_CORES below): with `-n 3` a third worker runs only these, beside the two busy ones,
# instead of a busy worker idling through them. A file or a test id.
WAITING = (  # cores measured in a full run of 2026-11-26 (RFT_TEST_CORES), the seconds it took
    "tests/integration/test_group_stall.py",  # 0.21 and 0.01 cores, 118 s and 39 s: the watchdog's 21 s and 35 s bounds
    "tests/integration/test_gpu_requirements.py::test_gpu_requirements_resolve_binary_only",  # 0.29, 94 s: the registry
    "tests/integration/test_explorer_continuous.py::test_continuous_reloads_between_versions[drain]",  # 0.37, 67 s
    "tests/integration/test_admission.py::test_a_fleet_of_three_never_takes_more_than_the_bound_on_the_broker",  # 0.04
    "tests/integration/test_task_selection.py::test_rft_publish_online_keeps_a_bounded_lead_and_stops_on_sigterm",
    "tests/integration/test_transport.py::test_rebalance_when_a_second_consumer_joins",  # 0.05: the group's rebalance
    "tests/integration/test_transport.py::test_commits_survive_a_consumer_restart",  # these three: 0.02-0.04, 5-6 s
    "tests/integration/test_transport_fidelity.py::test_scenario[commits_survive_a_consumer_restart]",
    "tests/integration/test_feed.py::test_feed_exactly_once_across_restart",
)


def work_unit(nodeid: str) -> str:
    """The scheduler's unit of `nodeid`: "heavy" (the whole runs of tests/e2e/, one after another on one worker),
    "late:<file>" (a LATE file; "late:tests/slurm/" for the Slurm tests), "wait:<test>" (a WAITING test) or the test
    itself."""
    if nodeid.startswith(WAITING):
        return "wait:" + nodeid
    if nodeid.startswith("tests/slurm/"):
        return "late:tests/slurm/"
    if nodeid.startswith(LATE):
        return "late:" + nodeid.split("::")[0]
    return "heavy" if nodeid.startswith(HEAVY_DIRS) else nodeid


def next_unit(queue: list[str], waiter: bool) -> str | None:
    """The unit a worker takes next from `queue` (xdist's order, largest first): the waiting worker takes only
    "wait:" units (None: it has nothing left to do), the others the rest, LATE units last, and "wait:" units only
    when nothing else is left."""
    waiting = [u for u in queue if u.startswith("wait:")]
    if waiter:
        return waiting[0] if waiting else None
    rest = [u for u in queue if not u.startswith(("wait:", "late:"))] + [u for u in queue if u.startswith("late:")]
    return (rest or waiting or [None])[0]


def may_take(unit: str, pending: int) -> bool:
    """Whether a worker holding `pending` tests not yet finished takes `unit` now. xdist hands a worker more work while
    it holds up to 2 tests (a worker keeps its last test until it knows what comes next), so a LATE unit handed early
    waits behind another on a busy worker while the other worker runs out of work (seen: 140 s at the end of a run); a
    LATE unit goes only to a worker on its last test."""
    return not unit.startswith("late:") or pending <= 1


@pytest.hookimpl(optionalhook=True, tryfirst=True)
def pytest_xdist_make_scheduler(config, log):
    """`make test` runs three pytest-xdist workers with `--dist loadgroup`: the whole runs of tests/e2e/ form one work
    unit, which one worker runs one test after another, so no two of them share the 2 cores; the second worker runs
    the rest beside it, one at a time: unit tests, integration tests that mostly wait on the broker or on processes,
    and those with one vLLM engine, which stay under a core (test_explorer_fleet 0.8, test_ray_fleet 0.76,
    test_explorer_continuous 0.5); the third (the last worker, where there are three or more) runs only the WAITING
    tests and stops when they are done. The LATE files wait at the end of the queue: whichever busy worker is done
    first takes them (before, the whole heavy set ran on one worker, 37 min, while the other was idle after 22).
    (xdist's own loadgroup, by `xdist_group` marks, renames nodes in a way pytest 9 no longer reads: this scheduler
    groups by path instead.) Other `--dist` modes are xdist's own."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling  # an optional plugin: this hook runs only where it is installed

    class HeavyInTurn(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return work_unit(nodeid)

        def _waiter(self, node) -> bool:
            ids = sorted(int(n.workerinput["workerid"][2:]) for n in self.nodes)
            return len(ids) >= 3 and int(node.workerinput["workerid"][2:]) == ids[-1]

        def _assign_work_unit(self, node) -> None:
            unit = next_unit(list(self.workqueue), self._waiter(node))
            if unit is None:
                node.shutdown()  # the waiting worker, with no waiting test left: it ends after those it holds
                return
            if not may_take(unit, self._pending_of(self.assigned_work.get(node, {}))):
                return  # asked again when its next test ends
            self.workqueue.move_to_end(unit, last=False)  # xdist's OrderedDict: its own method takes the first
            super()._assign_work_unit(node)

    return HeavyInTurn(config, log)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """With RFT_TEST_CORES=<file>, one JSON line per test: its worker, when it ended, its wall time and the CPU time of
    its worker and of the processes it started and waited for (setup, call and teardown), so `cores` says how busy it
    keeps the machine (how WAITING was chosen). A process the test killed without waiting for it is not counted: a
    test whose parts are reaped elsewhere reads near 0 and is not taken for waiting on that alone."""
    path = os.environ.get("RFT_TEST_CORES")
    if not path:
        yield
        return
    start = time.monotonic(), resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    yield
    wall = time.monotonic() - start[0]
    cpu = sum(u.ru_utime + u.ru_stime for u in (resource.getrusage(resource.RUSAGE_SELF),
                                                resource.getrusage(resource.RUSAGE_CHILDREN)))
    cpu -= sum(u.ru_utime + u.ru_stime for u in start[1:])
    with open(path, "a") as f:
        f.write(json.dumps({"test": item.nodeid, "worker": os.environ.get("PYTEST_XDIST_WORKER"),
                            "ended": round(time.time(), 1), "wall_s": round(wall, 2), "cpu_s": round(cpu, 2),
                            "cores": round(cpu / max(wall, 1e-6), 2)}) + "\n")


# The shared broker refuses a record batch over this many bytes with MESSAGE_TOO_LARGE, as a default Apache Kafka
# broker does (rft.broker.limits): Kafka's default message.max.bytes (1 MiB + 12), so a record of
# kafka.max_record_bytes (1,000,000 by default) plus its batch framing fits, as on a default cluster, and a test that
# sends a bigger record meets the limit a production broker would put on it.
BROKER_MAX_MESSAGE_BYTES = 1_048_588


@pytest.fixture(scope="session")
def broker():
    """One real Kafka-protocol broker for the whole session, enforcing BROKER_MAX_MESSAGE_BYTES; tests isolate by
    topic name."""
    with LocalBroker(max_message_bytes=BROKER_MAX_MESSAGE_BYTES) as b:
        yield b


@pytest.fixture
def bootstrap(broker) -> str:
    return broker.bootstrap_servers


@pytest.fixture
def kafka_cfg() -> KafkaConfig:
    return KafkaConfig(partitions=2, session_timeout_ms=6000, max_poll_interval_ms=5000)


_counter = itertools.count()


@pytest.fixture
def topic_prefix() -> str:
    return f"t{next(_counter)}-{uuid.uuid4().hex[:6]}"


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """The default tiny Qwen2 model (GQA, tied embeddings), generated once per session."""
    from rft.models.tiny import make_tiny_model
    return make_tiny_model(tmp_path_factory.mktemp("models") / "tiny-qwen2")


@pytest.fixture
def hf_dir(tmp_path):
    """A Hugging Face model directory's non-weight files (config, tokenizer) and an old weights file that a weight
    store must not copy beside a version (tests of rft.weights.store and rft.weights.bucket)."""
    d = tmp_path / "hf"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    (d / "tokenizer.json").write_text("{}")
    (d / "model.safetensors").write_bytes(b"old weights, must not be copied")
    return d
