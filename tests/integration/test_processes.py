"""rft.processes on real processes: a free port binds, a signal reaches a child's whole session (its own child
too), a stop escalates to SIGKILL, and /proc finds a process by its command line until it is gone."""
from __future__ import annotations

import signal
import socket
import subprocess
import sys
import uuid

from rft.processes import (
    alive,
    command_line,
    free_port,
    kill_matching,
    matching,
    signal_group,
    signals_blocked,
    stop_group,
    wait_gone,
)
from tests.waiting import wait_until

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


# a parent with a second thread running (where a preexec_fn may deadlock the child) that starts a sleeper through
# dying_with_parent from that thread and prints its pid, then waits to be killed
PARENT = """
import subprocess, sys, threading, time
from rft.processes import dying_with_parent
def start():
    child = subprocess.Popen(dying_with_parent([sys.executable, "-c", "import time; time.sleep(600)", sys.argv[1]]))
    print(child.pid, flush=True)
    time.sleep(600)
threading.Thread(target=start, daemon=True).start()
time.sleep(600)
"""


def test_a_child_started_dying_with_parent_dies_when_its_parent_is_killed_outright():
    tag = f"rft-test-{uuid.uuid4().hex}"
    parent = subprocess.Popen([sys.executable, "-c", PARENT, tag], stdout=subprocess.PIPE, text=True,
                              start_new_session=True)
    try:
        child = int(parent.stdout.readline())
        # setpriv asks for the signal, then execs the command (same pid): a parent killed before that is not seen
        wait_until(lambda: (command_line(child) or "").split()[-1:] == [tag], timeout=30,
                   what="setpriv to exec the command")
        parent.kill()
        parent.wait()
        assert wait_gone(child, timeout_s=30), f"the child {child} outlived its parent"
    finally:
        kill_matching(tag)
        parent.kill()


def test_a_child_started_with_signals_blocked_begins_with_them_blocked_and_the_parent_gets_its_mask_back():
    before = signal.pthread_sigmask(signal.SIG_BLOCK, set())
    with signals_blocked({signal.SIGUSR1, signal.SIGTERM}):
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        status = dict(line.split(":\t", 1) for line in open(f"/proc/{child.pid}/status").read().splitlines()
                      if ":\t" in line)
        blocked = int(status["SigBlk"], 16)
        assert blocked & (1 << (signal.SIGUSR1 - 1)) and blocked & (1 << (signal.SIGTERM - 1))
        assert signal.pthread_sigmask(signal.SIG_BLOCK, set()) == before
    finally:
        child.kill()
        child.wait()
