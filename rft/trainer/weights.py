"""The trainer's weight synchronisation: `WeightSync` is the one owner of the order in which each version of the
policy's weights goes out to the explorers (its class docstring is the contract; rft.weights states what the
explorers see of it). It runs on every trainer rank and delegates the delivery itself to rank 0's
`WeightPublisher` (rft.weights.publisher: pull or push, write-behind) and, per pipeline stage on the pull path, to a
later stage's `StagePublisher`. `deliver_version` and `deliver_buckets` are its collective steps, also used alone by
tests/distributed/test_push_abort.py.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Protocol

from rft.trainer import distributed as dist_io
from rft.weights.config import SyncConfig
from rft.weights.publisher import StagePublisher, WeightPublisher
from rft.weights.store import Staging
from rft.weights.stores import VersionStore, open_store


class NonFiniteWeights(RuntimeError):
    """The policy's weights hold NaN or infinity after a step: the trainer stops rather than publish them."""


class Layout(Protocol):
    pp: int
    pp_rank: int
    is_stage_publisher: bool


class ExportingPolicy(Protocol):
    """What WeightSync needs of the policy (megatron_bridge.policy.MegatronPolicy)."""
    layout: Layout

    def weights_finite(self) -> bool: ...
    def iter_hf_buckets(self, bucket_bytes: int, *, per_stage: bool = False) -> Iterator[dict]: ...
    def adapter_config(self) -> dict | None: ...


def deliver_version(version: int, attempt: Callable[[int], bool]) -> None:
    """Collective, on every trainer rank: deliver weights `version`. `attempt(version)` is one collective try: every
    rank takes part in the bucket export, rank 0 delivers and returns whether it did (a push can fail), the other
    ranks return True. A failed push is redone once by the pull path, which needs the buckets gathered again; rank 0
    tells every rank so (dist_io.broadcast_flag). RuntimeError when the redo fails too."""
    delivered = attempt(version)
    if dist_io.broadcast_flag(not delivered) and not attempt(version):
        raise RuntimeError(f"weights version {version} could not be delivered")


def deliver_buckets(version: int, buckets: Iterable[dict],
                    deliver: Callable[[int, Iterator[dict]], bool] | None) -> bool:
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


class WeightSync:
    """The order in which each version of the weights goes out, on every trainer rank. Version s is:
      1. exported after optimizer step s (version 0, the initial weights, before the first step of a fresh run),
         and only when the weights are finite on every rank (else `NonFiniteWeights`: such a version never goes
         out); every rank takes part in the bucket export, rank 0 hands it to its `WeightPublisher`; on the pull
         path with pipeline parallelism each later stage's publishing rank writes its own shards (`StagePublisher`)
         into the staging directory rank 0 opened and broadcast;
      2. written, then announced (pull: the whole version stored, then `Weights` with the feed's consumed offsets),
         or announced, then pushed (push: `WeightsPush`, then the broadcast);
      3. awaited before the next optimizer step: a push until every explorer acked; a pull until it is stored and
         announced, or with write-behind until its tensors are copied to host memory (the write goes on in the
         background, one version in flight: the next version's delivery waits for it first, so versions are
         announced in order);
      4. on failure: a failed push is announced abandoned and the same version is exported again on every rank and
         pulled (RuntimeError if that fails too); a failed background write raises at the next `publish` or `flush`;
      5. flushed (`flush`) before a checkpoint commits (a checkpoint at step s exists only once version s is out)
         and before the trainer announces that it finished; `close` (shutdown, error paths too) finishes the
         background writes, logging a failure, and closes the push group.
    `publisher` and `offsets` (the feed's consumed offsets, carried by each announcement) are rank 0's, None on the
    other ranks; `lora`: each version is the policy's adapter, published whole by rank 0; `publishes`: False where
    the run's explorers do not read the trainer's weights (offline mode): then nothing goes out."""

    def __init__(self, policy: ExportingPolicy, sync: SyncConfig, run_dir: Path, *, publisher: WeightPublisher | None,
                 offsets: Callable[[], dict[str, int]] | None, lora: bool, publishes: bool = True):
        self.policy, self.sync, self.run_dir, self.lora, self.publishes = policy, sync, Path(run_dir), lora, publishes
        self.publisher, self.offsets = publisher, offsets
        if lora and publisher is not None:
            publisher.adapter_config = policy.adapter_config()
        self.seconds: float | None = None  # seconds the newest publish held up the trainer
        self._stage_publisher: StagePublisher | None = None  # a later pipeline stage's publishing rank (pull path)
        self._store: VersionStore | None = None  # this rank's handle on the store (`store`)

    def publish(self, version: int) -> None:
        """Collective: steps 1-4 for `version`. The seconds this holds up the trainer are `weights_s` (with
        write-behind the store write is not among them: `weights_write_s`)."""
        if not self.publishes:
            return
        if version and not self.policy.weights_finite():  # collective
            raise NonFiniteWeights(f"step {version}: the policy's weights hold NaN or infinity; version {version} "
                                   f"is not published (the last good one is version {version - 1})")
        started = time.time()
        deliver_version(version, self._attempt)
        self.seconds = time.time() - started

    def flush(self) -> None:
        """Step 5: wait until the newest version is stored and announced (rank 0), or this later stage's share of it
        written; raises if that failed."""
        if self.publisher is not None:
            self.publisher.flush()
        if self._stage_publisher is not None:
            self._stage_publisher.flush()

    def metrics(self) -> dict:
        """Rank 0's: `weights_s`, seconds of this step spent publishing its version (critical path);
        `weights_write_s`: the newest finished store write + announcement (in the background with write-behind)."""
        if self.seconds is None:
            return {}
        write_s = self.publisher.last_write_s if self.publisher is not None else None
        return {"weights_s": self.seconds, **({"weights_write_s": write_s} if write_s is not None else {})}

    def close(self) -> None:
        """Finish the background writes (a failure is logged) and close the push group; before the control sink
        closes (the publisher announces on it)."""
        if self.publisher is not None:
            self.publisher.close()
        if self._stage_publisher is not None:
            self._stage_publisher.close()

    def store(self) -> VersionStore:
        """This rank's handle on the run's weight store, opened once (a bucket store keeps the delta base of the
        shards this rank writes): rank 0's publisher's, or one of its own on a later stage's publishing rank."""
        if self._store is None:
            self._store = self.publisher.store if self.publisher is not None else open_store(self.sync, self.run_dir)
        return self._store

    def _attempt(self, version: int) -> bool:
        """One collective try at delivering `version` (see `deliver_version`)."""
        staging = self._staging(version)
        buckets = self.policy.iter_hf_buckets(self.sync.bucket_mb << 20, per_stage=staging is not None)
        if self.publisher is not None and self.offsets is not None:
            publisher, offsets = self.publisher, self.offsets()
            return deliver_buckets(version, buckets,
                                   lambda v, b: publisher.deliver(v, b, offsets=offsets, staging=staging))
        if staging is not None and self.policy.layout.is_stage_publisher:
            self._stage().deliver(staging, buckets)  # the pull path: a failure raises, no redo
            return True
        return deliver_buckets(version, buckets, None)

    def _staging(self, version: int) -> Staging | None:
        """Collective when pp > 1: rank 0 decides how `version` goes out. On the pull path each pipeline stage's
        publishing rank writes its own shards into the staging directory rank 0 opens in the store (rft.weights);
        None: every tensor funnels to rank 0 (the push path, a version stored already, or a single stage)."""
        if self.policy.layout.pp == 1 or self.lora:  # an adapter is published whole by rank 0
            return None
        plan = None
        if self.publisher is not None:
            publisher = self.publisher
            staging = publisher.store.stage(version, self.policy.layout.pp) if publisher.method == "pull" else None
            plan = [staging.to_json()] if staging is not None else []
        plan = dist_io.broadcast_bytes(plan)
        return self.store().staging_from_json(plan[0]) if plan else None

    def _stage(self) -> StagePublisher:
        if self._stage_publisher is None:
            self._stage_publisher = StagePublisher(self.sync, store=self.store(), stage=self.policy.layout.pp_rank)
        return self._stage_publisher
