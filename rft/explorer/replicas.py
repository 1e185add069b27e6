"""`rft explorer --replicas N`: supervision of N explorer processes on one host (the explorer: explorer.py)."""
from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys

from rft.processes import dying_with_parent


def run_replicas(args: argparse.Namespace, replicas: int) -> int:
    """`--replicas N`: N child processes `rft explorer CONFIG [MORE_CONFIGS] --explorer-id PREFIX-i`; returns the worst
    exit code.

    Each child has its own session, so a signal reaches it exactly once: SIGTERM / SIGINT to this process
    (or Ctrl-C in its terminal) is passed on to every child, which finishes its batch and leaves; a second
    one aborts them. On Linux a child also gets SIGTERM when this process dies, even by SIGKILL."""
    prefix = args.explorer_id or f"{socket.gethostname()}-{os.getpid()}"
    extra = [a for o in args.overrides for a in ("--set", o)]
    if args.exit_when_idle is not None:
        extra += ["--exit-when-idle", str(args.exit_when_idle)]
    children = [subprocess.Popen(dying_with_parent([sys.executable, "-m", "rft.cli", "explorer", args.config,
                                                    *args.more_configs, "--explorer-id", f"{prefix}-{i}", *extra]),
                                 start_new_session=True) for i in range(replicas)]

    def forward(signum, frame):
        for child in children:
            if child.poll() is None:
                child.send_signal(signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    return max(child.wait() for child in children)
