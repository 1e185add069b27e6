"""The tests' one way to wait for an event: `wait_until` polls a condition until it holds, and fails with a message
that names what was awaited, the last value seen and why it stopped waiting (the time ran out, or a process it
depends on exited), with the caller's context (a log's tail) appended. A test never sleeps a fixed time in place
of an event; a test of absence (nothing more arrives) may sleep, and says so in a comment."""
from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")


class WaitTimeout(AssertionError):
    """A wait that ended without its condition: the time ran out, or a process it watched exited."""


def wait_until(predicate: Callable[[], T], *, timeout: float, what: str, interval: float = 0.1,
               alive: Iterable = (), context: Callable[[], str] | None = None,
               between: Callable[[], object] | None = None) -> T:
    """Call `predicate()` until it returns something truthy, and return that value.

    `timeout`: seconds before giving up. `what`: the awaited event, for the failure message ("3 groups"). Between
    two calls it sleeps `interval` seconds, or calls `between()` instead where given (e.g. a topic reader's poll,
    which blocks by itself). `alive`: processes (anything with `poll()`, e.g. subprocess.Popen) that must keep
    running while it waits: one that exited fails the wait at once. `context()`: text appended to the failure
    message (a log's tail), read only on failure. Exceptions raised by `predicate` propagate unchanged.

    Raises WaitTimeout (an AssertionError) naming `what`, the last value `predicate` returned and the reason."""
    watched = list(alive)
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        exited = {_name(p): p.poll() for p in watched if p.poll() is not None}
        if exited or time.monotonic() > deadline:
            reason = f"exited first: {exited}" if exited else f"timed out after {timeout:g} s"
            message = f"waiting for {what}: {reason}; last value seen: {_short(value)}"
            if context is not None:
                message += "\n" + context()
            raise WaitTimeout(message)
        if between is not None:
            between()
        else:
            time.sleep(interval)


def tail_of(log: Path, chars: int = 4000) -> Callable[[], str]:
    """A `context` for `wait_until`: the last `chars` characters of the file `log` ("(none)" if it is not there)."""
    return lambda: f"--- {log}:\n" + (log.read_text(errors="replace")[-chars:] if log.exists() else "(none)")


def _name(process) -> str:
    args = getattr(process, "args", None)
    return " ".join(map(str, args)) if isinstance(args, (list, tuple)) else str(args if args is not None else process)


def _short(value, limit: int = 300) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."
