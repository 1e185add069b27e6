"""Continuous submission (`explorer.continuous: true`): the engine stays full instead of each batch waiting for its
slowest sequence.

`Continuous` holds up to `explorer.max_inflight` tasks as engine requests (one request of n samples per task, through
the workflow's streaming interface `prepare` / `finish`, rft/workflows/__init__.py `streams`). The explorer loop
(rft/explorer/main.py `Explorer.run_continuous`) tops it up with newly polled tasks whenever slots are free, steps the
engine, and produces each group as soon as all n samples of its task are finished. Tasks therefore finish out of
order; `Offsets` says up to where each partition may be committed (below its lowest unfinished offset).

Weights. A newer version is loaded only when nothing is in flight: the loop stops admitting (drains), lets the
requests of the old version finish, reloads, resumes. So every sample of a group comes from the version the engine
held when the task's request was submitted; `Continuous.finished` checks it (EngineError otherwise) and each result
carries `submitted_version` / `finished_version` (also in the group's metadata).
"""
from __future__ import annotations

import dataclasses
import itertools
from typing import TYPE_CHECKING, Any

from rft.engine import EngineError
from rft.workflows import GroupResult

if TYPE_CHECKING:
    from rft.engine import Engine
    from rft.schema import TaskRecord


@dataclasses.dataclass
class Inflight:
    """One task's request in the engine; `source` is the caller's handle (the task's Kafka message)."""
    task: "TaskRecord"
    source: Any
    submitted_version: int


@dataclasses.dataclass
class Finished:
    source: Any
    result: "GroupResult"
    submitted_version: int
    finished_version: int


class Continuous:
    """Up to `max_inflight` tasks' worth of sequences in `engine` at once, each task one request of the workflow's
    `sampling`. Not
    thread-safe; the engine must have the streaming methods (`submit`, `step`: VLLMEngine)."""

    def __init__(self, engine: "Engine", workflow: Any, max_inflight: int):
        for name in ("submit", "step"):
            if not callable(getattr(engine, name, None)):
                raise EngineError(f"explorer.continuous: the {type(engine).__name__} has no request-level API "
                                  f"({name}); use explorer.engine vllm")
        self.engine, self.workflow, self.max_inflight = engine, workflow, max_inflight
        self.inflight: dict[str, Inflight] = {}
        self._ids = itertools.count()

    def free(self) -> int:
        """Tasks that may be submitted now: the engine holds at most `max_inflight` x n unfinished sequences, so the
        slots of a group's samples that finished early are refilled before the group's last sample is done (an
        engine without `unfinished()` counts tasks)."""
        unfinished = getattr(self.engine, "unfinished", None)
        if unfinished is None:
            return max(0, self.max_inflight - len(self.inflight))
        n = max(1, getattr(self.workflow.sampling, "n", 1))
        return max(0, (self.max_inflight * n - unfinished()) // n)

    def submit(self, task: "TaskRecord", source: Any) -> Finished | None:
        """Start `task`; None once it is in the engine, or its finished (error) result when it cannot be explored."""
        prompt = self.workflow.prepare(task, self.engine)
        version = self.engine.weights_version
        if isinstance(prompt, str):
            return Finished(source, GroupResult(task, error=prompt), version, version)
        request_id = f"{task.group_id}#{next(self._ids)}"
        self.engine.submit(request_id, prompt, self.workflow.sampling)
        self.inflight[request_id] = Inflight(task, source, version)
        return None

    def step(self) -> list[Finished]:
        """One engine iteration; the tasks whose n samples all finished in it, scored (`workflow.finish`)."""
        if not self.inflight:
            return []
        done = []
        for request_id, generation in self.engine.step():
            started = self.inflight.pop(request_id)
            version = self.engine.weights_version
            if version != started.submitted_version:
                raise EngineError(f"request {request_id} was submitted with weights version "
                                  f"{started.submitted_version} and finished with {version}: weights were reloaded "
                                  f"while it was in flight")
            done.append(Finished(started.source, self.workflow.finish(started.task, generation),
                                 started.submitted_version, version))
        return done


class Offsets:
    """Task offsets in flight per partition (`position` = "topic:partition"); `committable()` gives, per partition
    with news, the offset to commit: one past the highest done offset, but never past the lowest unfinished one, so a
    task is committed only once its group (and every earlier task's) is on the broker."""

    def __init__(self) -> None:
        self._open: dict[str, set[int]] = {}
        self._done: dict[str, int] = {}  # one past the highest done offset
        self._committed: dict[str, int] = {}  # the last offset committed (or, before any, the first started)

    def start(self, position: str, offset: int) -> None:
        self._open.setdefault(position, set()).add(offset)
        self._committed.setdefault(position, offset)

    def done(self, position: str, offset: int) -> None:
        still = self._open.get(position)
        if still is None:  # forgotten (rebalance): nothing to commit for it here
            return
        still.discard(offset)
        self._done[position] = max(self._done.get(position, 0), offset + 1)

    def unfinished(self) -> int:
        return sum(len(v) for v in self._open.values())

    def committable(self) -> dict[str, int]:
        out = {}
        for position, done in self._done.items():
            still = self._open.get(position)
            offset = min(min(still), done) if still else done
            if offset > self._committed[position]:
                out[position] = offset
        return out

    def committed(self, offsets: dict[str, int]) -> None:
        self._committed.update(offsets)

    def forget(self, positions: set[str]) -> None:
        """Partitions no longer held (a rebalance): their tasks are re-delivered to whoever holds them now."""
        for position in positions:
            self._open.pop(position, None)
            self._done.pop(position, None)
            self._committed.pop(position, None)
