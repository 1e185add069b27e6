"""The explorer's parts, composed once (rft/explorer/explorer.py `Explorer`) and handed to its loop as one
`ExplorerParts` (rft/explorer/batch.py, continuous.py). The loops call these parts and nothing else:

  intake, delivery   a task's way in and out (rft/explorer/pipeline.py);
  membership         the tasks consumer group and its watchdog (rft/explorer/membership.py);
  weights            `EngineWeights`: keeps the engine's weights current (pushed, then pulled), announces each load;
  warm_up            `WarmUp`: the engine's one-time costs paid while the consumer group forms;
  metrics            `ExplorerMetrics`: the Prometheus gauges after each delivery (absent endpoint: nothing);
  stats              the counters every heartbeat sends (rft/explorer/stats.py).
The engine is the one the composition chose: on a CPU run's core board, paced (rft/engine/paced.py).
"""
from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from rft.engine.base import SamplingSettings
from rft.transport import TransportError, lag
from rft.transport.control import ExplorerWeights, Kind
from rft.weights.subscriber import load_newest_weights

if TYPE_CHECKING:
    from rft.engine import Engine
    from rft.explorer.admission import Admission
    from rft.explorer.config import ExplorerConfig
    from rft.explorer.membership import Membership
    from rft.explorer.pipeline import Delivery, TaskIntake
    from rft.explorer.stats import ExplorerStats
    from rft.observability.prometheus import MetricsEndpoint
    from rft.transport import RecordSink
    from rft.weights.subscriber import PushMembership, WeightUpdates
    from rft.workflows import GroupResult, Workflow

log = logging.getLogger("rft.explorer")

WARM_UP_PROMPT = "Hello."
WARM_UP_TOKENS = 2  # a prefill and a decode step: enough for the first generate's one-time costs


class Announcer:
    """Sends this explorer's control messages (rft/transport/control.py kinds) to the control topic through `sink`."""

    def __init__(self, sink: RecordSink, control_topic: str):
        self.sink, self.control_topic = sink, control_topic

    def __call__(self, message: Kind) -> None:
        self.sink.send_record(self.control_topic, message.to_message())


class EngineWeights:
    """The engine's weights kept current: versions pushed to it (`push`, with `sync.method: push`), then the newest
    trusted version of the store or the announcements (`updates`). Each load is announced (`explorer_weights`) and
    told to admission (`set_version`, never backwards); `stats.weights_refused` follows `updates.refused`."""

    def __init__(self, *, engine: Engine, updates: WeightUpdates, push: PushMembership | None, admission: Admission,
                 announce: Callable[[Kind], None], explorer_id: str, stats: ExplorerStats):
        self.engine, self.updates, self.push, self.admission = engine, updates, push, admission
        self.announce, self.explorer_id, self.stats = announce, explorer_id, stats
        self._version_told = -1  # the newest version admission was told of

    def newer(self) -> bool:
        """Whether a version newer than the engine's is out (store or announcement)."""
        return self.updates.newest(above=self.engine.weights_version) is not None

    def refresh(self, load: Callable[[Path, int], None] | None = None) -> bool:
        """Take part in pushed versions (push path), then reload in place if a newer version is in the store (pull
        path, `load_newest_weights`; `load(path, version)` loads it, default the engine's `load_weights`); raises if
        the engine cannot be brought up to date. False while the engine must not generate: a push failed part-way and
        no whole version has been loaded since (`PushMembership.engine_whole`)."""
        if self.push is not None:
            for version in self.push.sync():
                log.info("loaded weights version %d (pushed)", version)
                self._loaded(version, seconds=None)
        try:
            loaded = load_newest_weights(self.engine, lambda: self.updates.newest(above=self.engine.weights_version),
                                         load=load)
        except RuntimeError as e:
            raise RuntimeError(f"explorer {self.explorer_id}: {e}") from None
        self.stats.weights_refused = self.updates.refused
        if loaded is not None:
            self._loaded(*loaded)
            if self.push is not None:
                self.push.loaded()
        return self.push is None or self.push.engine_whole

    def _loaded(self, version: int, seconds: float | None) -> None:
        self.announce(ExplorerWeights(explorer_id=self.explorer_id, version=version, seconds=seconds))
        if version > self._version_told:  # a restarted trainer may push an older version: admission stays
            self._version_told = version
            self.admission.set_version(version)


class WarmUp:
    """An engine's first generate pays one-time costs, and a broker holds a new consumer group's join a few seconds
    (Tansu; Apache Kafka's `group.initial.rebalance.delay.ms`). So both loops call the warm-up after a poll that brought
    no task: the first time, if the tasks consumer still waits for its group's answer to its join
    (`RecordSource.joined`), one generate of `tasks_per_batch` copies of a short prompt, `n_samples` each,
    WARM_UP_TOKENS new tokens, the output dropped (docs/architecture.md, docs/benchmarks.md: the measured effect). Never
    again after the first call: when the group answered already, the first batch pays the costs itself."""

    def __init__(self, *, engine: Engine, config: ExplorerConfig, membership: Membership, explorer_id: str):
        self.engine, self.config, self.membership, self.explorer_id = engine, config, membership, explorer_id
        self._due = True

    def __call__(self) -> None:
        due, self._due = self._due, False
        tasks = self.membership.tasks
        if not due or tasks is None or tasks.joined:
            return
        c = self.config
        sampling = SamplingSettings(n=c.n_samples, temperature=c.temperature, top_p=c.top_p,
                                    max_tokens=min(WARM_UP_TOKENS, c.max_tokens))
        started = time.monotonic()
        self.engine.generate([self.engine.encode(WARM_UP_PROMPT)] * c.tasks_per_batch, sampling)
        log.info("explorer %s warmed its engine up in %.1f s while its consumer group formed", self.explorer_id,
                 time.monotonic() - started)


class ExplorerMetrics:
    """After each delivery, with a metrics endpoint (`prometheus`; None: nothing): the counters, the weights version,
    the tokens per second of the delivered groups, and the group's lag on the tasks topic (left out when unreadable).
    """

    def __init__(self, *, prometheus: MetricsEndpoint | None, stats: ExplorerStats, engine: Engine,
                 membership: Membership, tasks_topic: str):
        self.prometheus, self.stats, self.engine = prometheus, stats, engine
        self.membership, self.tasks_topic = membership, tasks_topic
        self._samples_total = 0

    def export(self, results: list[GroupResult], seconds: float) -> None:
        """`results` were generated in `seconds`."""
        if self.prometheus is None:
            return
        samples = [s for r in results for s in r.samples]
        self._samples_total += len(samples)
        values = {"rft_explorer_groups_total": self.stats.groups, "rft_explorer_samples_total": self._samples_total,
                  "rft_explorer_dead_letters_total": self.stats.dead_letters,
                  "rft_explorer_admission_waits_total": self.stats.admission_waits,
                  "rft_explorer_weights_refused_total": self.stats.weights_refused,
                  "rft_explorer_control_refused_total": self.membership.control.view.malformed,
                  "rft_explorer_weights_version": self.engine.weights_version,
                  "rft_explorer_failed_samples_total": sum(self.stats.failed.values()),
                  "rft_explorer_tokens_per_second": sum(len(s.response_tokens) for s in samples) / max(seconds, 1e-9)}
        tasks = self.membership.tasks
        try:
            if tasks is not None:
                end = tasks.end_offsets(self.tasks_topic)
                positions = tasks.positions()
                values["rft_explorer_tasks_lag_records"] = lag(end, positions, positions)
        except TransportError:
            pass
        self.prometheus.update(values)


@dataclasses.dataclass(frozen=True)
class ExplorerParts:
    """What an explorer's loop works with (the module docstring); `config` is the explorer's own section."""
    config: ExplorerConfig
    engine: Engine
    workflow: Workflow
    intake: TaskIntake
    delivery: Delivery
    membership: Membership
    weights: EngineWeights
    warm_up: WarmUp
    metrics: ExplorerMetrics
    stats: ExplorerStats
