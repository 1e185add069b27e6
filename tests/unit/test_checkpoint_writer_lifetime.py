"""megatron's checkpoint writer keeps a "spawn" manager process; megatron_bridge starts it so that it dies with the
process that owns it. Here a real child process starts it and is then killed with SIGKILL (what the fault tests do
to a trainer): the manager must be gone within seconds, not orphaned."""
from __future__ import annotations

import signal
import subprocess
import sys

from rft.processes import alive
from tests.waiting import wait_until

CHILD = """
import multiprocessing, time
from megatron_bridge.policy import checkpoint_writer_dies_with_us
if __name__ == "__main__":
    checkpoint_writer_dies_with_us()
    print(multiprocessing.active_children()[0].pid, flush=True)
    time.sleep(600)
"""


def test_the_writer_process_dies_with_a_killed_trainer(tmp_path):
    script = tmp_path / "owner.py"
    script.write_text(CHILD)
    owner = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        manager_pid = int(owner.stdout.readline())
        assert alive(manager_pid)
        owner.send_signal(signal.SIGKILL)
        owner.wait(timeout=30)
        wait_until(lambda: not alive(manager_pid), timeout=10,
                   what="the checkpoint writer's manager to end with its owner (not orphaned)")
    finally:
        owner.kill()
