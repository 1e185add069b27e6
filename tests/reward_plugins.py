"""Per-response rewards that misbehave, by import path (`tests.reward_plugins:<name>`), for the reward workers'
tests (a worker process imports them with the parent's sys.path): `flaky` follows its task's metadata; and
`even_characters`, a reward a random model's samples almost never tie on (tests/e2e/test_vlm_run.py: its steps need
a gradient, which exact_match's all-zero groups of a random model would not give)."""
from __future__ import annotations

import os
import time

from rft.rewards.registry import TaskError
from rft.schema import TaskRecord


def flaky(response: str, task: TaskRecord) -> float | None:
    """metadata `hang_once`: a path; the first call (no file there yet) creates it and hangs for ever, in C (a
    sleep no thread can interrupt), the others score 1. `raise`: raises. `none`: None (unscored). `bad_task`: a
    TaskError (the task's fault). `chatty`: prints to stdout first. Else 0.5."""
    meta = task.metadata
    if meta.get("hang_once"):
        if not os.path.exists(meta["hang_once"]):
            open(meta["hang_once"], "w").close()
            time.sleep(10 ** 6)
        return 1.0
    if meta.get("raise"):
        raise ZeroDivisionError("the verifier divided by zero")
    if meta.get("none"):
        return None
    if meta.get("bad_task"):
        raise TaskError("metadata bad_task: this task cannot be scored")
    if meta.get("chatty"):
        print("a verifier that prints to stdout", flush=True)
    return 0.5


def even_characters(response: str, task: TaskRecord) -> float:
    """The share of the response's characters whose code point is even (0 for an empty response): random samples
    of a few characters seldom all score alike, so GRPO's advantages are not all zero."""
    return sum(ord(c) % 2 == 0 for c in response) / len(response) if response else 0.0
