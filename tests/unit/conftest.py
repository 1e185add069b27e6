"""Fixtures of the unit tests, and the unit tier's rule: a unit test starts no process.

While a test of tests/unit/ sets up, runs or tears down, starting a process (subprocess, os.fork / posix_spawn /
system, multiprocessing, so torchrun, the local broker and `rft` commands too) raises `ProcessInUnitTest`, and an
attempt that the code under test swallowed fails the test afterwards. Tests that need processes live in
tests/integration/ (or distributed/, e2e/; tests/README.md).
"""
from __future__ import annotations

import contextlib
import ctypes.util
import json
import multiprocessing.process
import os
import platform
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest


class ProcessInUnitTest(RuntimeError):
    """A unit test started a process."""


# (owner, attribute): what starts a process. Popen's child (Popen closes the pipes it made) covers subprocess.run /
# check_output, os.popen and asyncio's subprocesses; BaseProcess.start every multiprocessing context (so
# torch.multiprocessing and process pools too).
STARTERS = [(subprocess.Popen, "_execute_child"), (multiprocessing.process.BaseProcess, "start")] + [
    (os, name) for name in ("fork", "forkpty", "posix_spawn", "posix_spawnp", "system", "spawnv", "spawnve",
                            "spawnvp", "spawnvpe", "execv", "execve") if hasattr(os, name)]


# The standard library's questions about the machine, which some libraries ask when imported (vLLM's dependencies
# among them): `platform` runs `uname -p` and `file -b`, `ctypes.util.find_library` runs `ldconfig -p`. A lookup,
# not a process the test starts.
LOOKUPS = (platform.__file__, ctypes.util.__file__)


def _library_lookup() -> bool:
    """Whether the start comes from one of LOOKUPS."""
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_filename in LOOKUPS:
            return True
        frame = frame.f_back
    return False


@contextlib.contextmanager
def no_processes(test: str) -> Iterator[list[str]]:
    """Every starter of STARTERS refuses while inside; yields the list of attempts (`owner.attribute`)."""
    attempts: list[str] = []
    saved = [(owner, name, getattr(owner, name)) for owner, name in STARTERS]

    def refuse(what: str, original):
        def starter(*args, **kwargs):
            if _library_lookup():
                return original(*args, **kwargs)
            attempts.append(what)
            raise ProcessInUnitTest(f"{test} started a process ({what}): a unit test starts no process; move it to "
                                    "tests/integration/ (tests/README.md)")
        return starter

    for owner, name, original in saved:
        setattr(owner, name, refuse(f"{getattr(owner, '__name__', owner)}.{name}", original))
    try:
        yield attempts
    finally:
        for owner, name, original in saved:
            setattr(owner, name, original)


def _guarded(item: pytest.Item):
    with no_processes(item.nodeid) as attempts:
        result = yield
    if attempts:  # the code under test caught the error: the test still fails
        raise ProcessInUnitTest(f"{item.nodeid} tried to start a process ({', '.join(attempts)}): a unit test "
                                "starts no process; move it to tests/integration/ (tests/README.md)")
    return result


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
    return (yield from _guarded(item))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    return (yield from _guarded(item))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    return (yield from _guarded(item))


@pytest.fixture
def model_dir(tmp_path) -> Path:
    """A model directory with only a config.json: enough for the architecture and parallel-size checks."""
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"architectures": ["Qwen2ForCausalLM"], "num_attention_heads": 4,
                                               "num_key_value_heads": 2,
                                               "num_hidden_layers": 2}))
    return d
