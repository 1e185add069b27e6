"""Neither rft.transport nor the in-memory fake the unit tests use imports kafka-python, seen in a fresh interpreter
(the transport itself: tests/unit/test_transport_memory.py, tests/integration/test_transport.py)."""
from __future__ import annotations

import subprocess
import sys


def test_the_transport_package_and_the_fake_import_no_kafka():
    code = ("import sys, rft.transport, rft.transport.memory, rft.trainer.feed, rft.transport.run_topics, "
            "rft.ops.topics.render; "
            "assert 'kafka' not in sys.modules, 'kafka imported'")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
