"""The suite's own xdist work units (tests/conftest.py work_unit): whole runs of tests/e2e/ in one unit (one worker,
one after another), the LATE files one unit each, the Slurm directory one unit (one cluster), the WAITING tests one
unit each, the rest a test each; and which unit each worker takes next (next_unit)."""
from __future__ import annotations

from tests.conftest import WAITING, may_take, next_unit, work_unit


def test_work_units():
    assert work_unit("tests/e2e/test_chaos.py::test_x") == work_unit("tests/e2e/test_modes.py::test_y") == "heavy"
    assert work_unit("tests/e2e/test_gpu_check.py::test_z") == "late:tests/e2e/test_gpu_check.py"
    a, b = (work_unit(f"tests/distributed/test_lora.py::test_{n}") for n in "ab")
    assert a == b == "late:tests/distributed/test_lora.py"
    assert work_unit("tests/distributed/test_moe.py::test_a") != a
    assert work_unit("tests/slurm/test_one.py::t") == work_unit("tests/slurm/test_two.py::t") == "late:tests/slurm/"
    assert work_unit("tests/unit/test_config.py::test_a") == "tests/unit/test_config.py::test_a"
    assert work_unit(WAITING[0] + "::test_a") == "wait:" + WAITING[0] + "::test_a"


def test_the_waiting_worker_takes_only_waiting_units_and_the_others_take_them_last():
    queue = ["late:tests/distributed/test_lora.py", "heavy", "wait:tests/a.py::t", "tests/unit/test_b.py::t"]
    assert next_unit(queue, waiter=True) == "wait:tests/a.py::t"
    assert next_unit(queue, waiter=False) == "heavy"
    assert next_unit(queue[:1] + queue[2:3], waiter=False) == "late:tests/distributed/test_lora.py"
    assert next_unit(queue[2:3], waiter=False) == "wait:tests/a.py::t"  # nothing else left: a busy worker helps
    assert next_unit(["heavy", "late:x"], waiter=True) is None  # the waiting worker stops
    assert next_unit([], waiter=False) is None


def test_every_waiting_entry_names_a_test_that_exists():
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    for entry in WAITING:
        path, _, test = entry.partition("::")
        assert (repo / path).is_file(), entry
        if test:
            assert f"def {test.split('[')[0]}(" in (repo / path).read_text(), entry


def test_a_late_unit_goes_only_to_a_worker_on_its_last_test():
    assert may_take("late:tests/distributed/test_lora.py", 1) and may_take("late:tests/slurm/", 0)
    assert not may_take("late:tests/distributed/test_lora.py", 2)
    assert may_take("tests/unit/test_config.py::test_a", 2) and may_take("heavy", 0)
