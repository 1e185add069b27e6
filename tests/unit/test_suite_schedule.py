"""The suite's own xdist work units (tests/conftest.py work_unit): whole runs of tests/e2e/ in one unit (one worker,
one after another), the LATE files one unit each, the Slurm directory one unit (one cluster), the rest a test each."""
from __future__ import annotations

from tests.conftest import work_unit


def test_work_units():
    assert work_unit("tests/e2e/test_chaos.py::test_x") == work_unit("tests/e2e/test_modes.py::test_y") == "heavy"
    assert work_unit("tests/e2e/test_gpu_check.py::test_z") == "late:tests/e2e/test_gpu_check.py"
    a, b = (work_unit(f"tests/distributed/test_lora.py::test_{n}") for n in "ab")
    assert a == b == "late:tests/distributed/test_lora.py"
    assert work_unit("tests/distributed/test_moe.py::test_a") != a
    assert work_unit("tests/slurm/test_one.py::t") == work_unit("tests/slurm/test_two.py::t") == "late:tests/slurm/"
    assert work_unit("tests/unit/test_config.py::test_a") == "tests/unit/test_config.py::test_a"
