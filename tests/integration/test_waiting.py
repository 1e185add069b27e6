"""tests/waiting.py, the tests' one wait helper: it returns the condition's value, and its failures name what was
awaited, the last value seen and why (the time ran out, or a watched process exited first), with the context."""
from __future__ import annotations

import subprocess
import sys
import time

import pytest

from tests.waiting import WaitTimeout, tail_of, wait_until


def test_returns_the_first_truthy_value_and_calls_between_instead_of_sleeping():
    seen: list[int] = []
    value = wait_until(lambda: [n for n in seen if n >= 3], timeout=5, what="a 3",
                       between=lambda: seen.append(len(seen)))
    assert value == [3] and seen == [0, 1, 2, 3]


def test_a_timeout_names_what_the_last_value_and_the_context(tmp_path):
    log = tmp_path / "run.log"
    log.write_text("first line\nthe last line of the log\n")
    calls = []

    def never() -> int:
        calls.append(1)
        return 0

    started = time.monotonic()
    with pytest.raises(WaitTimeout) as failure:
        wait_until(never, timeout=0.3, interval=0.05, what="the answer", context=tail_of(log))
    assert 0.3 <= time.monotonic() - started < 3 and len(calls) >= 3
    message = str(failure.value)
    assert message.startswith("waiting for the answer: timed out after 0.3 s; last value seen: 0")
    assert "the last line of the log" in message
    assert isinstance(failure.value, AssertionError)  # pytest reports it as a failed assertion


def test_a_watched_process_that_exits_fails_the_wait_at_once():
    process = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    process.wait()
    started = time.monotonic()
    with pytest.raises(WaitTimeout, match=r"waiting for never: exited first: \{'.*SystemExit\(3\)': 3\}"):
        wait_until(lambda: False, timeout=60, what="never", alive=[process])
    assert time.monotonic() - started < 5


def test_the_predicates_own_errors_propagate():
    with pytest.raises(ZeroDivisionError):
        wait_until(lambda: 1 / 0, timeout=5, what="a division")
