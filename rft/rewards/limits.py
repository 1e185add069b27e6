"""Per-response rewards under a time limit: worker processes that a hung verifier cannot stall.

A per-response reward function (registered name or `package.module:function`) is called in a worker process
(`python -m rft.rewards.worker`, `RewardWorkers`), one call at a time per worker, each under `timeout_s`
(`explorer.reward_timeout_s`). A call past its limit kills its worker (SIGKILL: a verifier hung in C, sympy or
math-verify, cannot be interrupted in a thread; and `signal.alarm` only works in a main thread) and starts a new
one for the next call; the response is a failed rollout of class `timeout`. A reward that raises is `verifier`, one
that returns None `unscored` (rft/rewards/registry.py); a `TaskError` or `RewardError` raised in the worker is
raised again here, as in-process. Workers start on first use; the time a worker takes to start (its imports) is
not counted against a call.

Nothing is pickled: a request and its answer are msgpack maps over the worker's stdin / stdout, framed by a 4-byte
big-endian length: the reward's spec, the response text, the task's fields; the worker resolves the reward by that
spec in its own registry (the built-ins, and import paths, with the parent's sys.path). Stateful rewards (a judge:
factories with an engine) run in the explorer's process; their model calls have their engine's limits.

`score_in_process` is the same contract without a worker or a limit (unit tests, and rewards built without
workers).
"""
from __future__ import annotations

import logging
import os
import queue
import select
import struct
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import msgpack

from rft.rewards.registry import RewardError, RewardResult, TaskError, checked
from rft.schema import TaskRecord

log = logging.getLogger(__name__)

FRAME = struct.Struct(">I")
MAX_FRAME_BYTES = 64 << 20  # a response, a task (its metadata) or an answer over this is refused
START_TIMEOUT_S = 120.0  # a worker's imports (rft.rewards, math-verify on first use is per call)
TASK_FIELDS = ("run_id", "task_id", "epoch", "prompt", "answer", "metadata", "created_at")


def score_in_process(name: str, fn: Callable[[str, TaskRecord], Any], response: str, task: TaskRecord) -> RewardResult:
    """`fn(response, task)` checked (registry.checked), a raise other than TaskError / RewardError made a `verifier`
    failure: the contract a worker runs, without its time limit."""
    try:
        return checked(name, fn(response, task))
    except (TaskError, RewardError):
        raise
    except Exception as e:  # the verifier crashed on this response: a failed rollout, not a 0
        log.warning("reward %s raised %s: %s", name, type(e).__name__, e)
        return RewardResult(0.0, {}, failure="verifier")


def task_fields(task: TaskRecord) -> dict[str, Any]:
    return {k: getattr(task, k) for k in TASK_FIELDS}


def write_frame(stream: Any, body: dict[str, Any]) -> None:
    data = msgpack.packb(body, use_bin_type=True)
    stream.write(FRAME.pack(len(data)) + data)
    stream.flush()


def read_frame(stream: Any) -> dict[str, Any] | None:
    """The next frame of a blocking stream, None at its end."""
    head = stream.read(FRAME.size)
    if len(head) < FRAME.size:
        return None
    (size,) = FRAME.unpack(head)
    if size > MAX_FRAME_BYTES:
        raise ValueError(f"a frame of {size} bytes, over {MAX_FRAME_BYTES}")
    body = stream.read(size)
    if len(body) < size:
        return None
    return msgpack.unpackb(body, raw=False)


class _Timeout(Exception):
    pass


class _Died(Exception):
    pass


class _Worker:
    """One worker process; `request` answers one frame within a deadline (_Timeout, _Died otherwise)."""

    def __init__(self, command: list[str], env: dict[str, str]):
        self.process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env,
                                        start_new_session=True)
        self._buffer = b""
        ready = self._read(time.monotonic() + START_TIMEOUT_S)
        if not ready.get("ready"):
            raise RewardError(f"reward worker did not start: {ready}")

    def request(self, body: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        assert self.process.stdin is not None
        try:
            write_frame(self.process.stdin, body)
        except (BrokenPipeError, OSError) as e:
            raise _Died(f"reward worker is gone ({e})") from None
        return self._read(time.monotonic() + timeout_s)

    def _read(self, deadline: float) -> dict[str, Any]:
        assert self.process.stdout is not None
        fd = self.process.stdout.fileno()
        while True:
            if len(self._buffer) >= FRAME.size:
                (size,) = FRAME.unpack(self._buffer[:FRAME.size])
                if size > MAX_FRAME_BYTES:
                    raise _Died(f"reward worker sent a frame of {size} bytes")
                if len(self._buffer) >= FRAME.size + size:
                    body = self._buffer[FRAME.size:FRAME.size + size]
                    self._buffer = self._buffer[FRAME.size + size:]
                    return msgpack.unpackb(body, raw=False)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise _Timeout()
            readable, _, _ = select.select([fd], [], [], remaining)
            if readable:
                chunk = os.read(fd, 1 << 16)
                if not chunk:
                    raise _Died(f"reward worker exited (status {self.process.poll()})")
                self._buffer += chunk

    def kill(self) -> None:
        try:
            os.killpg(self.process.pid, 9)
        except OSError:
            pass
        self.process.wait()
        for stream in (self.process.stdin, self.process.stdout):
            if stream is not None:
                try:
                    stream.close()
                except OSError:
                    pass


class RewardWorkers:
    """`workers` reward worker processes, each call under `timeout_s` (the module docstring). Thread-safe: a call
    waits for an idle worker. `failures` counts the calls that failed per class (timeout, verifier)."""

    def __init__(self, *, timeout_s: float, workers: int = 1):
        if timeout_s <= 0 or workers < 1:
            raise ValueError(f"reward workers need timeout_s > 0 and workers >= 1, got {timeout_s}, {workers}")
        self.timeout_s, self.size = timeout_s, workers
        self._idle: queue.SimpleQueue[_Worker | None] = queue.SimpleQueue()
        for _ in range(workers):
            self._idle.put(None)  # started on first use
        self._live: set[_Worker] = set()
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="rft-reward") if workers > 1 else None
        self.failures: dict[str, int] = {}
        self._closed = False
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        self._command, self._env = [sys.executable, "-m", "rft.rewards.worker"], env
        self._finalizer = weakref.finalize(self, RewardWorkers._kill_all, self._live)

    @classmethod
    def from_config(cls, explorer: Any) -> RewardWorkers:
        """The workers of `explorer.reward_timeout_s` / `explorer.reward_workers`."""
        return cls(timeout_s=explorer.reward_timeout_s, workers=explorer.reward_workers)

    def score(self, name: str, responses: Sequence[str], task: TaskRecord) -> list[RewardResult]:
        """The reward `name` of each response (in order), each call in a worker under the limit."""
        if self._pool is None or len(responses) < 2:
            return [self.call(name, r, task) for r in responses]
        return list(self._pool.map(lambda r: self.call(name, r, task), responses))

    def call(self, name: str, response: str, task: TaskRecord) -> RewardResult:
        """One response's reward: a failed one (`timeout`, `verifier`) when the worker timed out or died."""
        if self._closed:
            raise RewardError("reward workers are closed")
        worker = self._idle.get()
        try:
            if worker is None:
                worker = self._start()
            answer = worker.request({"reward": name, "response": response, "task": task_fields(task)},
                                    self.timeout_s)
        except _Timeout:
            log.warning("reward %s: no answer within explorer.reward_timeout_s=%g s; its worker is killed",
                        name, self.timeout_s)
            worker = self._retire(worker)  # the slot starts a new worker on its next call
            return self._failed("timeout")
        except _Died as e:
            log.warning("reward %s: %s", name, e)
            worker = self._retire(worker)
            return self._failed("verifier")
        finally:
            self._idle.put(worker)
        return self._result(name, answer)

    def _result(self, name: str, answer: dict[str, Any]) -> RewardResult:
        if "task_error" in answer:
            raise TaskError(str(answer["task_error"]))
        if "reward_error" in answer:
            raise RewardError(str(answer["reward_error"]))
        failure = str(answer.get("failure") or "")
        if failure:
            if answer.get("message"):
                log.warning("reward %s failed (%s): %s", name, failure, answer["message"])
            self._count(failure)
        score = answer.get("score", 0.0)
        components = answer.get("components") or {}
        if not isinstance(score, (int, float)) or not isinstance(components, dict):
            raise RewardError(f"reward worker answered {answer!r}")
        return checked(name, RewardResult(float(score), {str(k): float(v) for k, v in components.items()},
                                          failure=failure))

    def _failed(self, failure: str) -> RewardResult:
        self._count(failure)
        return RewardResult(0.0, {}, failure=failure)

    def _count(self, failure: str) -> None:
        with self._lock:
            self.failures[failure] = self.failures.get(failure, 0) + 1

    def _start(self) -> _Worker:
        worker = _Worker(self._command, self._env)
        with self._lock:
            self._live.add(worker)
        return worker

    def _retire(self, worker: _Worker | None) -> _Worker | None:
        """Kill `worker`; None, what its slot holds until the next call starts a new one."""
        if worker is not None:
            worker.kill()
            with self._lock:
                self._live.discard(worker)
        return None

    def close(self) -> None:
        """Kill every worker (idempotent); later calls raise RewardError."""
        self._closed = True
        if self._pool is not None:
            self._pool.shutdown(wait=False)
        self._finalizer()

    @staticmethod
    def _kill_all(live: set[_Worker]) -> None:
        for worker in list(live):
            worker.kill()
        live.clear()
