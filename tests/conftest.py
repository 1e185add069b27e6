"""Shared fixtures: a real local broker (Tansu over TCP), tiny HF models, a unique topic prefix."""
from __future__ import annotations

import itertools
import json
import os
import uuid

import pytest

from rft.broker.local import LocalBroker
from rft.config import KafkaConfig

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# The suite's runs share 2 cores two at a time (below) and train models of 0.3 M parameters, which one thread does as
# fast as two: one OpenMP thread per process (the runs' parts inherit it; rft run's split of the cores is
# tests/unit/test_launcher_parts.py's) measured the e2e tests 9% faster side by side than two spinning threads each.
os.environ.setdefault("OMP_NUM_THREADS", "1")

# The tests that keep more than one core busy for most of their time (a whole run, torchrun ranks: measured 1.1 to
# 1.4 cores on average, e.g. test_serve_run, test_trainer_dpo, test_slurm_launchers) or hold the session's one Slurm
# cluster: those marked e2e, distributed or slurm, which live in these directories (checked at collection).
HEAVY_MARKS = ("e2e", "distributed", "slurm")
HEAVY_DIRS = ("tests/e2e/", "tests/distributed/", "tests/slurm/")
# Of those, the ones whose checks do not depend on how fast they run (numbers against a reference, one Slurm job
# after another, the GPU check's rows): both workers take them at the end of the session, a file at a time (the
# Slurm directory as one unit: one cluster), so neither worker idles while the other finishes.
LATE = ("tests/distributed/", "tests/slurm/", "tests/e2e/test_gpu_check.py")


def pytest_collection_modifyitems(items):
    """A test marked e2e, distributed or slurm outside HEAVY_DIRS would run beside the heavy ones: refused."""
    stray = [i.nodeid for i in items
             if any(i.get_closest_marker(m) for m in HEAVY_MARKS) and not i.nodeid.startswith(HEAVY_DIRS)]
    if stray:
        raise pytest.UsageError(f"tests marked {'/'.join(HEAVY_MARKS)} must live in {', '.join(HEAVY_DIRS)} "
                                f"(tests/conftest.py runs those one at a time under xdist): {stray}")


def work_unit(nodeid: str) -> str:
    """The scheduler's unit of `nodeid`: "heavy" (the whole runs of tests/e2e/, one after another on one worker),
    "late:<file>" (a LATE file; "late:tests/slurm/" for the Slurm tests) or the test itself."""
    if nodeid.startswith("tests/slurm/"):
        return "late:tests/slurm/"
    if nodeid.startswith(LATE):
        return "late:" + nodeid.split("::")[0]
    return "heavy" if nodeid.startswith(HEAVY_DIRS) else nodeid


@pytest.hookimpl(optionalhook=True, tryfirst=True)
def pytest_xdist_make_scheduler(config, log):
    """`make test` runs two pytest-xdist workers with `--dist loadgroup`: the whole runs of tests/e2e/ form one work
    unit, which one worker runs one test after another, so no two of them share the 2 cores; the other worker runs
    the rest beside it, one at a time: unit tests, integration tests that mostly wait on the broker, on timeouts or
    on processes (test_group_stall: 0.26 cores over its 2 minutes), and those with one vLLM engine, which stay under a
    core (test_explorer_fleet 0.8, test_ray_fleet 0.76, test_explorer_continuous 0.5). The LATE files wait at the end
    of the queue: whichever worker is done first takes them (before, the whole heavy set ran on one worker, 37 min,
    while the other was idle after 22). (xdist's own loadgroup, by `xdist_group` marks, renames nodes in a way
    pytest 9 no longer reads: this scheduler groups by path instead.) Other `--dist` modes are xdist's own."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling  # an optional plugin: this hook runs only where it is installed

    class HeavyInTurn(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return work_unit(nodeid)

        def _assign_work_unit(self, node) -> None:
            for scope in [s for s in self.workqueue if s.startswith("late:")]:
                self.workqueue.move_to_end(scope)  # the queue is xdist's OrderedDict, largest units first
            super()._assign_work_unit(node)

    return HeavyInTurn(config, log)


@pytest.fixture(scope="session")
def broker():
    """One real Kafka-protocol broker for the whole session; tests isolate by topic name."""
    with LocalBroker() as b:
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
