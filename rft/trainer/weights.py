"""How the trainer delivers each version of its weights (rft.weights: the ordering contract), a part of the trainer
(rft.trainer.main.Trainer):

  deliver_version   the collective around one version: one try on every rank, and one redo by the pull path when
                    rank 0's push failed;
  deliver_buckets   one rank's part in a try: hand the bucket export to the publisher (rank 0), read it to its end;
  TrainerWeights    the trainer's weight publishing on every rank: how a version goes out (funnelled to rank 0, or
                    per pipeline stage into the store: `Staging`), the later stages' `StagePublisher`, the wait for
                    write-behind (`flush`), and the `weights_s` / `weights_write_s` metrics.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from rft.trainer import distributed as dist_io
from rft.weights.publisher import StagePublisher
from rft.weights.store import Staging
from rft.weights.stores import VersionStore, open_store

if TYPE_CHECKING:
    from rft.trainer.main import TrainerIO
    from rft.weights.config import SyncConfig


def deliver_version(version: int, attempt: Callable[[int], bool]) -> None:
    """Collective, on every trainer rank: deliver weights `version` (rft.weights). `attempt(version)` is one
    collective try: every rank takes part in the bucket export, rank 0 delivers and returns whether it did (a push
    can fail), the other ranks return True. A failed push is redone once by the pull path, which needs the buckets
    gathered again; rank 0 tells every rank so (dist_io.broadcast_flag). RuntimeError when the redo fails too."""
    delivered = attempt(version)
    if dist_io.broadcast_flag(not delivered) and not attempt(version):
        raise RuntimeError(f"weights version {version} could not be delivered")


def deliver_buckets(version: int, buckets: Iterable[dict], deliver: Callable[[int, Iterator[dict]], bool] | None) -> bool:
    """One rank's part in one try: hand `buckets` (megatron_bridge.export.iter_hf_buckets, where every rank takes
    part in each parameter's gathers and sends) to `deliver` (rank 0's WeightPublisher.deliver; None on the other
    ranks), then read the export to its end: all of it on ranks > 0, and on rank 0 what a push that failed midway
    left unread. So the abort is collective: every rank leaves the export after the same parameters and reaches
    `deliver_version`'s flag at the same point (a rank 0 that stopped reading left the others in a gather)."""
    buckets = iter(buckets)
    delivered = True if deliver is None else deliver(version, buckets)
    for _ in buckets:
        pass
    return delivered


class TrainerWeights:
    """The trainer's weight publishing, on every rank (module docstring). `policy`: the trainer's (its layout and
    `iter_hf_buckets`); `io`: rank 0's side of the run (its `weights` publisher and the feed whose offsets each
    announcement carries), None on the other ranks; `lora`: versions are adapters (published whole by rank 0)."""

    def __init__(self, policy, sync: SyncConfig, run_dir: Path, *, io: TrainerIO | None, lora: bool):
        self.policy, self.sync, self.run_dir, self.io, self.lora = policy, sync, Path(run_dir), io, lora
        self.seconds: float | None = None  # seconds the newest publish held up the trainer
        self._stage_weights: StagePublisher | None = None  # a later pipeline stage's publishing rank (pull path)
        self._store: VersionStore | None = None  # this rank's handle on the store (`store`)

    def publish(self, version: int) -> None:
        """Collective: every rank takes part in gathering the buckets; rank 0 delivers them (`deliver_version`).
        The seconds this takes on the trainer's critical path are logged as `weights_s` (with write-behind, the
        store write is not among them: `weights_write_s`)."""
        started = time.time()
        deliver_version(version, self._deliver)
        self.seconds = time.time() - started

    def flush(self) -> None:
        """Rank 0: wait until the newest version is stored and announced (see WeightPublisher write-behind); a later
        pipeline stage's publishing rank: until its share of it is written."""
        if self.io is not None and self.io.weights is not None:
            self.io.weights.flush()
        if self._stage_weights is not None:
            self._stage_weights.flush()

    def metrics(self) -> dict:
        """Rank 0's: `weights_s`, seconds of this step spent publishing its version (critical path);
        `weights_write_s`: the newest finished store write + announcement (in the background with write-behind)."""
        if self.seconds is None:
            return {}
        write_s = self.io.weights.last_write_s if self.io.weights is not None else None
        return {"weights_s": self.seconds, **({"weights_write_s": write_s} if write_s is not None else {})}

    def close(self) -> None:
        """Stop a later stage's StagePublisher (rank 0's publisher is closed with its TrainerIO)."""
        if self._stage_weights is not None:
            self._stage_weights.close()

    def _deliver(self, version: int) -> bool:
        """One collective try at delivering `version` (see `deliver_version`)."""
        staging = self._staging(version)
        buckets = self.policy.iter_hf_buckets(self.sync.bucket_mb << 20, per_stage=staging is not None)
        if self.io is not None:
            offsets = dict(self.io.feed.state.offsets)
            return deliver_buckets(version, buckets, lambda v, b: self.io.weights.deliver(v, b, offsets=offsets,
                                                                                           staging=staging))
        if staging is not None and self.policy.layout.is_stage_publisher:
            self._stage_publisher().deliver(staging, buckets)  # the pull path: a failure raises, no redo
            return True
        return deliver_buckets(version, buckets, None)

    def _staging(self, version: int) -> Staging | None:
        """Collective when pp > 1: rank 0 decides how `version` goes out. On the pull path each pipeline stage's
        publishing rank writes its own shards into the staging directory rank 0 opens in the store (rft.weights);
        None: every tensor funnels to rank 0 (the push path, a version stored already, or a single stage)."""
        if self.policy.layout.pp == 1 or self.lora:  # an adapter is published whole by rank 0
            return None
        plan = None
        if self.io is not None:
            weights = self.io.weights
            staging = weights.store.stage(version, self.policy.layout.pp) if weights.method == "pull" else None
            plan = [staging.to_json()] if staging is not None else []
        plan = dist_io.broadcast_bytes(plan)
        return self.store().staging_from_json(plan[0]) if plan else None

    def store(self) -> VersionStore:
        """This rank's handle on the run's weight store, opened once (a bucket store keeps the delta base of the shards
        this rank writes): rank 0's publisher's, or one of its own on a later stage's publishing rank."""
        if self._store is None:
            weights = self.io.weights if self.io is not None else None
            self._store = weights.store if weights is not None else open_store(self.sync, self.run_dir)
        return self._store

    def _stage_publisher(self) -> StagePublisher:
        if self._stage_weights is None:
            self._stage_weights = StagePublisher(self.sync, store=self.store(), stage=self.policy.layout.pp_rank)
        return self._stage_weights
