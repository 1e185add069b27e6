"""The python tool's sandbox (rft/agent_tools): a real sandboxed interpreter per call, with nothing inherited, and
its time, memory and output limits (the tool box's parsing and errors: tests/unit/test_tools.py; escapes:
tests/security/test_data_python_sandbox.py)."""
from __future__ import annotations

import os
import time

import pytest

from rft.agent_tools import ToolBox, ToolCall, ToolLimits


@pytest.fixture(scope="module")
def box():
    return ToolBox(["calculator", "python"], ToolLimits(timeout_s=1.0, memory_mb=256, output_chars=200))


@pytest.fixture(scope="module")
def patient_box():
    """The same limits but time: for calls that must finish, however busy the machine (a sandboxed interpreter that
    prints a traceback took over 1 s beside a loaded suite)."""
    return ToolBox(["python"], ToolLimits(timeout_s=30.0, memory_mb=256, output_chars=200))


def test_python_sandbox(box, patient_box):
    run = lambda code: patient_box.run(ToolCall("python", {"code": code}))  # noqa: E731
    assert run("print(6 * 7)") == "42\n"
    assert run("x = 1") == "(no output)"
    assert run("import os; print(sorted(os.environ))") == (  # nothing inherited
        "['LC_ALL', 'MKL_NUM_THREADS', 'OMP_NUM_THREADS', 'OPENBLAS_NUM_THREADS', 'PYTHONIOENCODING']\n")
    assert run("import sys; print(sys.flags.isolated)") == "1\n"
    started = time.monotonic()
    assert box.run(ToolCall("python", {"code": "while True: pass"})).startswith("error: timed out after 1 s")
    assert time.monotonic() - started < 5
    memory = run("x = bytearray(1024 ** 3)")  # 1 GiB against a 256 MiB address-space limit
    assert memory.startswith("error: exit status 1") and "MemoryError" in memory
    failed = run("1 / 0")
    assert failed.startswith("error: exit status 1") and failed.rstrip().endswith("ZeroDivisionError: division by zero")
    long = run("print('x' * 5000)")
    assert long.startswith("x" * 200) and long.endswith("[truncated, 5001 characters]")
    flood = run("while True: print('y' * 100)")  # past the 1 MiB file limit, well before the time limit
    assert flood.startswith("error: output over 1048576 bytes") and len(flood) < 300



def test_python_sandbox_under_the_explorers_umask(patient_box):
    """`rft run` sets umask 077: the directories the sandbox makes on the way to the interpreter stay open to the
    code's user."""
    old = os.umask(0o077)
    try:
        assert patient_box.run(ToolCall("python", {"code": "import json; print(json.dumps([6 * 7]))"})) == "[42]\n"
    finally:
        os.umask(old)
