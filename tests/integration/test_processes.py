"""rft.processes on real processes: a free port binds, a signal reaches a child's whole session (its own child
too), a stop escalates to SIGKILL, and /proc finds a process by its command line until it is gone."""
from __future__ import annotations

import signal
import socket
import subprocess
import sys
import uuid

from rft.processes import alive, command_line, free_port, kill_matching, matching, signal_group, stop_group, wait_gone

# a child that ignores SIGTERM and starts a grandchild in its session, which prints its pid once it runs
STUBBORN = """
import signal, subprocess, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
subprocess.Popen([sys.executable, "-c", "import os, time; print(os.getpid(), flush=True); time.sleep(600)",
                  sys.argv[1] + "-g"])
time.sleep(600)
"""


def start(tag: str) -> tuple[subprocess.Popen, int]:
    process = subprocess.Popen([sys.executable, "-c", STUBBORN, tag], stdout=subprocess.PIPE, text=True,
                               start_new_session=True)
    return process, int(process.stdout.readline())


def test_a_free_port_can_be_bound():
    port = free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
    assert free_port("localhost") > 0


def test_the_group_signal_reaches_the_grandchild_and_the_stop_escalates_to_sigkill():
    tag = f"rft-test-{uuid.uuid4().hex}"
    process, grandchild = start(tag)
    try:
        assert sorted(matching(tag)) == sorted([process.pid, grandchild])
        assert tag in command_line(grandchild)
        assert stop_group(process, signal.SIGTERM, timeout_s=0.5) == -signal.SIGKILL  # SIGTERM was ignored
        assert wait_gone(grandchild, timeout_s=10), "the grandchild outlived its session's SIGKILL"
        assert not alive(process.pid) and matching(tag) == []
    finally:
        signal_group(process, signal.SIGKILL)
        process.wait()


def test_kill_matching_names_what_it_killed():
    tag = f"rft-test-{uuid.uuid4().hex}"
    process, grandchild = start(tag)
    try:
        assert kill_matching(f"{tag}-g") == [grandchild]  # only the grandchild's command line has it
        assert wait_gone(grandchild, timeout_s=10) and alive(process.pid)
        assert command_line(10 ** 9) is None and not alive(10 ** 9)
    finally:
        signal_group(process, signal.SIGKILL)
        process.wait()
