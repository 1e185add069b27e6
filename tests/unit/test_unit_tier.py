"""The unit tier's rule (tests/unit/conftest.py): while a unit test runs, every way of starting a process refuses
with `ProcessInUnitTest`, and each attempt is recorded (so one the code under test swallows still fails the test);
the standard library's lookups about the machine (`ctypes.util.find_library`, `platform`) are no process the test
starts."""
from __future__ import annotations

import ctypes.util
import multiprocessing
import os
import platform
import subprocess
import sys

import pytest
from conftest import ProcessInUnitTest, no_processes


def test_every_way_of_starting_a_process_is_refused_and_recorded():
    starts = {
        "Popen._execute_child": lambda: subprocess.run([sys.executable, "-c", "pass"], check=True),
        "BaseProcess.start": lambda: multiprocessing.get_context("spawn").Process(target=print).start(),
        "os.system": lambda: os.system("true"),
        "os.fork": lambda: os.fork(),
    }
    for what, start in starts.items():
        with no_processes("the test") as attempts:
            with pytest.raises(ProcessInUnitTest, match=r"the test started a process .*move it to tests/integration/"):
                start()
        assert attempts == [what]


def test_a_swallowed_attempt_is_still_recorded_and_the_machines_lookups_pass():
    tiers_own = subprocess.Popen._execute_child
    with no_processes("the test") as attempts:
        try:
            subprocess.run(["true"])
        except Exception:
            pass
        assert ctypes.util.find_library("c")  # runs ldconfig -p
        assert platform.architecture(sys.executable)[0]  # runs file -b
    assert attempts == ["Popen._execute_child"]
    assert subprocess.Popen._execute_child is tiers_own  # put back on the way out
