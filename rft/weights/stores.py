"""The weight store a run's config names, behind one interface: a directory (rft.weights.store.WeightStore, on a
filesystem the trainer and the explorers share) or an S3 bucket (rft.weights.bucket.BucketStore: `s3://` URLs,
each host reading through its cache). The trainer, explorers, `rft serve` and the evaluator use `open_store` and
the `VersionStore` methods, never which kind it is."""
from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from rft.weights.config import S3_SCHEME
from rft.weights.store import Lineage, LineagePin, Staging, WeightStore, store_root

if TYPE_CHECKING:
    import torch

    from rft.weights.config import SyncConfig


class VersionStore(Protocol):
    """What both stores offer (their docstrings state the contracts). `root`: the directory or the URL."""
    keep: int
    delta: bool  # whether it keeps the tensors it publishes as the next delta's base (then nothing may change them)

    @property
    def root(self) -> Path | str: ...  # read-only: a WeightStore's is a Path, a BucketStore's a str

    pin: LineagePin  # the lineage this process trusts (rft.weights.store: claimed by the trainer, else first read)

    def location(self, version: int) -> str: ...
    def read_lineage(self) -> Lineage | None: ...
    def create_lineage(self, lineage: Lineage) -> bool: ...
    def replace_lineage(self, lineage: Lineage) -> None: ...
    def latest(self) -> tuple[int, Path | str] | None: ...
    def versions(self) -> list[int]: ...
    def has(self, version: int) -> bool: ...
    def local(self, version: int, location: str | os.PathLike | None = None, *, checksums: bool = True) -> Path: ...
    def stage(self, version: int, stages: int) -> Staging | None: ...
    def staging_from_json(self, data: bytes) -> Staging: ...
    def write_stage(self, staging: Staging, stage: int, buckets: Iterable[dict[str, torch.Tensor]]) -> None: ...
    def publish(self, version: int, buckets: Iterable[dict[str, torch.Tensor]], hf_dir: str | os.PathLike | None,
                *, staging: Staging | None = None, wait_s: float = 120.0,
                adapter_config: dict | None = None) -> Path | str: ...


def open_store(sync: SyncConfig, run_dir: str | os.PathLike) -> VersionStore:
    """The store `sync.weight_store` names: an `s3://BUCKET/PREFIX` URL (with `sync.s3_endpoint`, `sync.s3_region`,
    `sync.cache_dir`, `sync.delta`, `sync.full_every`), else a directory (default `<run dir>/weights`, created);
    keeping `sync.keep_versions` versions."""
    if sync.weight_store.startswith(S3_SCHEME):
        from rft.weights.bucket import BucketStore  # heavy: obstore (only s3:// stores; not in gpu-check wheels)

        return BucketStore(sync.weight_store, keep=sync.keep_versions, cache_dir=sync.cache_dir or None,
                           delta=sync.delta, full_every=sync.full_every, endpoint=sync.s3_endpoint,
                           region=sync.s3_region)
    return WeightStore.for_sync(sync, run_dir)


def store_exists(sync: SyncConfig, run_dir: str | os.PathLike) -> bool:
    """Whether the run's store may hold versions, without creating a directory store (readers such as `rft eval`)."""
    if sync.weight_store.startswith(S3_SCHEME):
        return True
    return store_root(sync, run_dir).is_dir()
