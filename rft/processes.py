"""Dying with the parent process: a leaf module (standard library only), so that light modules such as
rft/broker/local.py can use it without importing rft.run.commandline's dependencies."""
from __future__ import annotations

import ctypes
import signal
import sys


def die_with_parent(sig: int = signal.SIGTERM) -> None:
    """In a child process: ask Linux to send `sig` when the parent dies (no-op elsewhere). Linux tracks the parent
    *thread*: a child started from a thread that ends gets `sig` then."""
    if sys.platform.startswith("linux"):
        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, sig)
