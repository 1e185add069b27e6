"""Shared fixtures: a real local broker (Tansu over TCP), tiny HF models, a unique topic prefix."""
from __future__ import annotations

import itertools
import os
import uuid

import pytest

from rft.broker.local import LocalBroker
from rft.config import KafkaConfig

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# What keeps the CPU busy (a whole run, torchrun ranks, a vLLM engine) or holds the session's one Slurm cluster.
HEAVY_MARKS = ("e2e", "distributed", "vllm", "slurm")


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the groups
def pytest_collection_modifyitems(items):
    """`make test` runs two pytest-xdist workers with `--dist loadgroup`: every test with one of HEAVY_MARKS is in
    the group `heavy`, which one worker runs one test after another, so no two of them share the 2 cores; the
    other worker runs the rest beside it (unit tests, and integration tests that mostly wait on the broker, on
    timeouts or on processes). Without xdist the group mark is inert."""
    for item in items:
        if any(item.get_closest_marker(mark) for mark in HEAVY_MARKS):
            item.add_marker(pytest.mark.xdist_group("heavy"))


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
