"""The scenarios of tests/transport_scenarios.py on the real broker: what the unit tests check of the in-memory
transport (rft/transport/memory.py) holds for Kafka too, so the fake stays faithful."""
from __future__ import annotations

import pytest

from rft.transport import connect
from rft.transport.config import KafkaConfig
from tests import transport_scenarios as scenarios

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("scenario", scenarios.SCENARIOS, ids=lambda s: s.__name__)
def test_scenario(scenario, bootstrap, kafka_cfg, topic_prefix):
    scenario(connect(kafka_cfg, bootstrap), topic_prefix)


def test_oversized_record_is_refused(bootstrap, topic_prefix):
    cfg = KafkaConfig(partitions=2, max_record_bytes=50_000)
    scenarios.oversized_record_is_refused(connect(cfg, bootstrap), topic_prefix, 50_000)
