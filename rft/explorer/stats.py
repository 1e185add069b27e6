"""The explorer's counters: each part updates its own (named in its docstring), every heartbeat sends them all."""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class ExplorerStats:
    """The explorer's counters, sent in each heartbeat (`explorer_heartbeat`, rft/explorer/explorer.py)."""
    groups: int = 0
    batches: int = 0
    dead_letters: int = 0
    admission_waits: int = 0  # polls in which admission control let no task start (waiting for the trainer)
    weights_refused: int = 0  # weights versions and push groups refused (rft.weights.subscriber: trust)
    explore_s: float = 0.0  # seconds spent in the workflow (generation and rewards) since joining
    joined_s: float = 0.0  # seconds since joining the tasks consumer group
    partitions: list[int] = dataclasses.field(default_factory=list)
    unassigned_s: float = 0.0  # how long it has held no tasks partition (0 while it holds some)
    rejoins: int = 0  # rejoins by the membership watchdog
    failed: dict[str, int] = dataclasses.field(default_factory=dict)  # failed samples per failure class (Delivery)
