"""Continuous submission (`explorer.continuous: true`): the engine stays full instead of each batch waiting for its
slowest sequence.

`Continuous` holds up to `explorer.max_inflight` tasks as engine requests (one request of n samples per task, through
the workflow's streaming interface `prepare` / `finish`, rft/workflows/__init__.py `streams`; a prompt with images,
an `ImagePrompt`, enters by `submit_images`). `ContinuousLoop`, the
explorer's loop in this mode, tops it up with newly polled tasks whenever slots are free, steps the engine, and
delivers each group as soon as all n samples of its task are finished (rft/explorer/pipeline.py: produce, acks, then
commit below the lowest unfinished offset of each partition, `Offsets`): tasks finish out of order.

Weights, two ways (`explorer.inflight_updates`).
- Drain (false, the default): a newer version is loaded only when nothing is in flight, so every sample of a group
  comes from the version the engine held when its request was submitted (`Continuous.step` checks it).
- In flight (true): a newer version is loaded between two engine steps with the requests kept
  (`VLLMEngine.load_weights_in_flight`, PipelineRL's update). Every token carries the version that generated it
  (`token_versions`; `version_spans` on the wire) and a group's `policy_version` is its oldest token's, which the
  trainer's staleness bound uses; admission's argument holds with it (rft/explorer/admission.py). The requests' KV
  cache is recomputed with the new weights (`explorer.inflight_kv: recompute`) or kept (`keep`, PipelineRL's choice;
  docs/architecture.md compares them).
Each result carries `submitted_version` / `finished_version` (also in the group's metadata).
"""
from __future__ import annotations

import dataclasses
import itertools
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from rft.engine import EngineError, ImagePrompt
from rft.explorer.parts import ExplorerParts
from rft.explorer.pipeline import POLL_S, IdleClock, Offsets, Outcome
from rft.workflows import GroupResult

if TYPE_CHECKING:
    from rft.engine import Engine
    from rft.engine.base import StreamingEngine
    from rft.schema import TaskRecord

log = logging.getLogger("rft.explorer")

WEIGHTS_CHECK_S = 0.5  # how often it looks for a newer weights version while generating
TOPUP_S = 0.02  # while requests are in flight, poll for tasks to fill free slots at most this often
MEMBERSHIP_CHECK_S = 1.0  # how often the membership watchdog runs while generating


@dataclasses.dataclass
class Inflight:
    """One task's request in the engine; `source` is the caller's handle (the task's Kafka message)."""
    task: TaskRecord
    source: Any
    submitted_version: int


@dataclasses.dataclass
class Finished:
    source: Any
    result: GroupResult
    submitted_version: int
    finished_version: int


class Continuous:
    """Up to `max_inflight` tasks' worth of sequences in `engine` at once, each task one request of the workflow's
    `sampling`. Not
    thread-safe; the engine must have the streaming methods (`submit`, `step`: VLLMEngine)."""

    def __init__(self, engine: Engine, workflow: Any, max_inflight: int, *, in_flight_updates: bool = False):
        for name in ("submit", "step") + (("load_weights_in_flight",) if in_flight_updates else ()):
            if not callable(getattr(engine, name, None)):
                raise EngineError(f"explorer.continuous: the {type(engine).__name__} has no request-level API "
                                  f"({name}); use explorer.engine vllm")
        self.engine = cast("StreamingEngine", engine)  # as checked above
        self.workflow, self.max_inflight = workflow, max_inflight
        self.in_flight_updates = in_flight_updates  # weights may change while a request is in flight
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

    def submit(self, task: TaskRecord, source: Any) -> Finished | None:
        """Start `task`; None once it is in the engine, or its finished (error) result when it cannot be explored."""
        prompt = self.workflow.prepare(task, self.engine)
        version = self.engine.weights_version
        if isinstance(prompt, str):
            return Finished(source, GroupResult(task, error=prompt), version, version)
        request_id = f"{task.group_id}#{next(self._ids)}"
        if isinstance(prompt, ImagePrompt):  # a task with images (rft.workflows.registry.image_prompt)
            try:
                self.engine.submit_images(request_id, prompt, self.workflow.sampling)
            except EngineError as e:  # the engine's own checks refused this prompt (vLLM's: too many images, ...)
                return Finished(source, GroupResult(task, error=str(e)), version, version)
        else:
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
            if version != started.submitted_version and not self.in_flight_updates:
                raise EngineError(f"request {request_id} was submitted with weights version "
                                  f"{started.submitted_version} and finished with {version}: weights were reloaded "
                                  f"while it was in flight")
            done.append(Finished(started.source, self.workflow.finish(started.task, generation),
                                 started.submitted_version, version))
        return done


class ContinuousLoop:
    """The explorer's loop with `explorer.continuous: true` (after `Explorer.join`), over its `parts`. Each turn:
      1. weights: every WEIGHTS_CHECK_S, look for a newer version (store or announcement); if there is one, load it
         at once, in flight (`explorer.inflight_updates`), or stop admitting (drain) and load it once nothing is in
         flight; `reloads` records (version, tasks in flight when it was loaded: 0 when draining);
      2. unless draining or stopping: poll, admit and submit tasks for the free slots (at most every TOPUP_S while
         requests are in flight; waiting up to POLL_S for tasks when none are);
      3. step the engine; deliver the groups whose n samples are done (produce, acks, then commit each partition below
         its lowest unfinished task: rft/explorer/pipeline.py);
      4. the membership watchdog (every MEMBERSHIP_CHECK_S while generating, every turn when idle); after a switch of
         consumer group the offsets start afresh: the new group re-delivers what was not committed.
    A stop finishes the tasks in flight (delivered and committed) and returns "stopped"; with `exit_when_idle_s`,
    "idle" once nothing was in flight, started or loaded for that long after the consumer group answered the join
    (`IdleClock`). `stats.batches` counts deliveries that produced at least one group. `sync.method: push` is refused
    (ValueError): a push is a collective taken between batches."""

    def __init__(self, parts: ExplorerParts):
        if parts.weights.push is not None:
            raise ValueError("explorer.continuous: sync.method push is not supported (a push is a collective the "
                             "explorer takes part in between batches); use sync.method pull")
        self.parts = parts
        self.in_flight = parts.config.inflight_updates
        self.recompute = parts.config.inflight_kv == "recompute"
        self.scheduler = Continuous(parts.engine, parts.workflow, parts.config.max_inflight,
                                    in_flight_updates=self.in_flight)
        self.offsets = Offsets()
        self.reloads: list[tuple[int, int]] = []  # (version, tasks in flight when it was loaded): 0 when draining
        self.draining = False
        self._weights_due = 0.0

    def run(self, stop: threading.Event, *, exit_when_idle_s: float | None = None) -> str:
        scheduler, parts = self.scheduler, self.parts
        membership_due = topup_due = 0.0
        idle = IdleClock(parts.membership, exit_when_idle_s)
        last_export = time.monotonic()
        while not (stop.is_set() and not scheduler.inflight):
            now = time.monotonic()
            reloaded = self._reload_in_flight(now) if self.in_flight else self._reload_when_drained(now)
            if reloaded:
                idle.work()  # a reload is work: the idle clock starts after it, not before
            started = time.monotonic()
            if self._may_start(stop, topup_due=topup_due, now=now):
                topup_due = now + TOPUP_S
                if self._start_tasks(block=not scheduler.inflight):
                    idle.work()
            finished = scheduler.step()
            parts.stats.explore_s += time.monotonic() - started
            if finished:
                self._deliver(finished, seconds=time.monotonic() - last_export)
                idle.work()
                last_export = time.monotonic()
            if not scheduler.inflight or now >= membership_due:
                membership_due = now + MEMBERSHIP_CHECK_S
                if parts.membership.watch():
                    self.offsets = Offsets()
            if not scheduler.inflight and idle.expired():
                return "idle"
            if not scheduler.inflight:
                parts.warm_up()
        return "stopped"

    def _reload_when_drained(self, now: float) -> bool:
        """Step 1 of the class docstring, draining: start draining when a newer version is out; load it once nothing
        is in flight. True when it loaded (or tried to)."""
        if not self.draining and now >= self._weights_due:
            self._weights_due = now + WEIGHTS_CHECK_S
            self.draining = self.parts.weights.newer()
        if self.draining and not self.scheduler.inflight:
            self._refresh()
            self.draining = False
            return True
        return False

    def _reload_in_flight(self, now: float) -> bool:
        """Step 1 of the class docstring, in flight: every WEIGHTS_CHECK_S, load the newest version now, between two
        engine steps, the requests in flight kept (`VLLMEngine.load_weights_in_flight`). True when it loaded."""
        if now < self._weights_due:
            return False
        self._weights_due = now + WEIGHTS_CHECK_S
        engine = self.scheduler.engine
        if not self.parts.weights.newer():
            return False
        self._refresh(lambda path, version: engine.load_weights_in_flight(path, version, recompute=self.recompute))
        return True

    def _refresh(self, load: Callable[[Path, int], None] | None = None) -> None:
        """Load the newest version (`EngineWeights.refresh`, with `load` when given) and record it in `reloads`."""
        engine = self.parts.engine
        before = engine.weights_version
        self.parts.weights.refresh(load)
        if engine.weights_version != before:
            self.reloads.append((engine.weights_version, len(self.scheduler.inflight)))
            log.info("loaded weights version %d with %d tasks in flight", engine.weights_version,
                     len(self.scheduler.inflight))

    def _may_start(self, stop: threading.Event, *, topup_due: float, now: float) -> bool:
        """Step 2's condition: not draining, not stopping, free slots, and the engine idle or a top-up due."""
        return (not self.draining and not stop.is_set() and self.scheduler.free() > 0
                and (not self.scheduler.inflight or now >= topup_due))

    def _start_tasks(self, *, block: bool) -> int:
        """Poll up to `scheduler.free()` tasks (waiting up to POLL_S when `block`), admit, decode, submit; returns the
        number of tasks handled (started or dead-lettered)."""
        taken = self.parts.intake.take(self.offsets, timeout_s=POLL_S if block else 0.0,
                                          max_records=self.scheduler.free(), wait=block)
        if not taken.admitted:
            return 0
        immediate = [f for f in (self.scheduler.submit(t, m) for m, t in zip(taken.sources, taken.tasks, strict=True))
                     if f is not None]
        if immediate or taken.diverted:  # dead letters: their offsets may be committed, their admission slots freed
            self._deliver(immediate, seconds=0.0, failed=taken.diverted)
        return taken.admitted

    def _deliver(self, finished: list[Finished], *, seconds: float, failed: int = 0) -> None:
        outcomes = [Outcome(f.source, f.result, {"submitted_version": f.submitted_version,
                                                 "finished_version": f.finished_version}) for f in finished]
        if self.parts.delivery.deliver(outcomes, self.offsets, failed=failed):
            self.parts.stats.batches += 1
        if finished:
            self.parts.metrics.export([f.result for f in finished], seconds)
