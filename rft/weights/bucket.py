"""Versioned weights in an S3 bucket: the pull path for fleets that share no filesystem with the trainer (rft.weights).

`sync.weight_store: s3://BUCKET/PREFIX`. Under PREFIX/: `vNNNNNNNN/<files>` as in a directory store
(rft.weights.store), optional `<shard>.delta` files (`sync.delta`), `vNNNNNNNN/rft-manifest.json` (written last: a
version exists for readers once its manifest does), and `LATEST`. The directory store's contract, on S3:
- Complete before visible: every file (and delta) is uploaded before the manifest, which names each one's size and
  SHA-256; readers trust only versions with a manifest, and only files that match it.
- Never rewritten: the manifest is created with `If-None-Match: *`; re-publishing an existing version is a no-op.
- LATEST only moves forward, by compare-and-swap (`If-None-Match: *` when absent, else `If-Match: <ETag>` only
  over an older version; a lost race reads again and retries).
- Garbage collection keeps the newest `keep` versions and LATEST's, deleting a manifest before its files; versions
  older than the one just published that never got a manifest are deleted too.
- Lineage (rft.weights.store's module docstring): `LINEAGE` is created with `If-None-Match: *`; every manifest
  carries the lineage and the version's checksum; the host cache serves a cached version only when its lineage is the
  store's (a stale cache's version of another run is removed and fetched again).
- Per-stage publishing: each pipeline stage's publishing rank writes its shards then `.stage-KK.json` (or
  `.failed`) under the version's prefix; the publishing rank waits for them as the directory store's does.
- Deltas: a shard of version v = last + 1 (v % `sync.full_every` != 0) also gets a delta when it is under half the
  shard; every version keeps all its full files, so a host without the base downloads whole files.
One writer per prefix; any number of readers. Readers never load from the bucket: each host's cache
(rft.weights.cache) fetches or rebuilds a version once, checks it and hands engines a local directory.
`BucketStore` reads, its `BucketWriter` writes (obstore). Credentials only from the environment (docs/security.md).
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import threading
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING

import obstore
from obstore.exceptions import AlreadyExistsError, NotFoundError, PreconditionError
from obstore.store import S3Store

from rft.weights import delta as deltas
from rft.weights.cache import HostCache
from rft.weights.config import S3_SCHEME, split_s3_url
from rft.weights.store import (
    ADAPTER_CONFIG,
    ADAPTER_FILE,
    CHECKSUM,
    INDEX,
    LATEST,
    LINEAGE,
    MANIFEST,
    Lineage,
    LineagePin,
    StageMerge,
    Staging,
    WeightStoreError,
    adapter_tensors,
    bytes_entry,
    check_publish,
    check_stage,
    check_stage_count,
    ensure_lineage,
    failure_reason,
    gather_stages,
    index_json,
    manifest_body,
    model_files,
    shard_tensors,
    stage_failed,
    stage_manifest,
    version_dirname,
)

if TYPE_CHECKING:
    import torch
    from obstore import PutMode
    from obstore.store import S3Config

log = logging.getLogger(__name__)

_MISSING = (NotFoundError, FileNotFoundError)  # obstore raises the builtin one for a 404
_VERSION_PREFIX = re.compile(r"v(\d{8})/")
MAX_DELTA_FRACTION = 0.5  # a shard's delta larger than this fraction of the shard is not written (float32: ~100 %)
UPLOADS_IN_FLIGHT = 4  # shards serialised and uploaded concurrently (each holds its bytes in memory)


class BucketStore:
    """The weight store on S3 (module docstring). `keep`: versions retained (>= 1); `delta`/`full_every`: write sparse
    deltas (module docstring), each only when smaller than `max_delta_fraction` of its shard; `cache_dir`: this host's
    cache directory (rft.weights.cache), created on first read; `endpoint`/`region`: override the environment's
    (module docstring). Two parts: this class reads (what is published, LATEST, the objects of a version, through
    this host's cache) and `writer`, a BucketWriter, publishes; `stage`, `write_stage` and `publish` hand over to it."""

    def __init__(self, url: str, *, keep: int = 2, cache_dir: str | os.PathLike | None = None, delta: bool = False,
                 full_every: int = 10, endpoint: str = "", region: str = "",
                 max_delta_fraction: float = MAX_DELTA_FRACTION):
        if keep < 1 or full_every < 1:
            raise WeightStoreError(f"keep and full_every must be >= 1, got {keep} and {full_every}")
        try:
            bucket, prefix = split_s3_url(url)
        except ValueError as e:
            raise WeightStoreError(str(e)) from None
        self.root = f"{S3_SCHEME}{bucket}/{prefix}".rstrip("/")
        self.keep, self.delta = keep, delta
        endpoint = endpoint or os.environ.get("AWS_ENDPOINT_URL", "") or os.environ.get("AWS_ENDPOINT", "")
        config: S3Config = {}
        if endpoint:
            config["endpoint"] = endpoint
        if region:
            config["region"] = region
        self.objects = S3Store(bucket, prefix=prefix or None, config=config,
                               client_options={"allow_http": endpoint.startswith("http://")})
        self.cache_dir = Path(cache_dir) if cache_dir else default_cache_dir()
        self._cache: HostCache | None = None
        self._cache_key = hashlib.sha256(f"{endpoint}|{self.root}".encode()).hexdigest()[:16]
        self.writer = BucketWriter(self, full_every=full_every, max_delta_fraction=max_delta_fraction)
        self.pin = LineagePin()

    # -- reading
    def location(self, version: int) -> str:
        """What announcements carry for `version`: its URL."""
        return f"{self.root}/{version_dirname(version)}"

    def latest(self) -> tuple[int, str] | None:
        """(version, location) that LATEST names, or None before the first publish."""
        found = self.read_latest()
        return None if found is None else (found[0], self.location(found[0]))

    def versions(self) -> list[int]:
        """Published versions present now (those with a manifest), ascending."""
        return [v for v in self.version_prefixes() if self.has(v)]

    def has(self, version: int) -> bool:
        try:
            obstore.head(self.objects, f"{version_dirname(version)}/{MANIFEST}")
            return True
        except _MISSING:
            return False

    def local(self, version: int, location: str | os.PathLike | None = None, *, checksums: bool = True) -> Path:
        """The local, checked directory of `version` (this host's cache fetches or builds it, rft.weights.cache).
        `location`: where an announcement said it is, which must be this store's URL of that version (else
        WeightStoreError). FileNotFoundError while the version is not published (or after it was collected)."""
        if location is not None and str(location) != self.location(version):
            raise WeightStoreError(f"{location} is not version {version}'s location in the weight store {self.root} "
                                   f"({self.location(version)})")
        return self.cache.materialize(version, checksums=checksums,
                                      lineage=self.pin.expect(self.read_lineage(), self.root))

    # -- lineage (rft.weights.store's module docstring)
    def read_lineage(self) -> Lineage | None:
        """The prefix's LINEAGE, None when it has none; WeightStoreError when it is corrupt."""
        try:
            data = bytes(obstore.get(self.objects, LINEAGE).bytes())
        except _MISSING:
            return None
        return Lineage.from_json(data, f"{self.root}/{LINEAGE}")

    def create_lineage(self, lineage: Lineage) -> bool:
        """Create LINEAGE unless there is one (`If-None-Match: *`); False when there was one."""
        try:
            obstore.put(self.objects, LINEAGE, lineage.to_json().encode(), mode="create", use_multipart=False)
            return True
        except AlreadyExistsError:
            return False

    def replace_lineage(self, lineage: Lineage) -> None:
        """LINEAGE replaced (readers refuse the old versions from now on), then LATEST and every version deleted."""
        obstore.put(self.objects, LINEAGE, lineage.to_json().encode(), use_multipart=False)
        try:
            obstore.delete(self.objects, LATEST)
        except _MISSING:
            pass
        for version in self.version_prefixes():
            self.writer.delete_version(version, manifest_first=True)

    @property
    def cache(self) -> HostCache:
        if self._cache is None:
            self._cache = HostCache(self.cache_dir / self._cache_key, self, keep=max(self.keep, 2))
        return self._cache

    def manifest(self, version: int) -> dict:
        """The manifest of a published version (FileNotFoundError when it has none), checked to be for it."""
        try:
            body = json.loads(self.read(version, MANIFEST))
        except ValueError as e:
            raise WeightStoreError(f"{self.location(version)}/{MANIFEST} is unreadable: {e}") from None
        if not isinstance(body, dict) or body.get("version") != version or body.get("algorithm") != CHECKSUM or \
                not isinstance(body.get("files"), dict):
            raise WeightStoreError(f"{self.location(version)}/{MANIFEST} is not version {version}'s manifest")
        return body

    def read(self, version: int, name: str) -> bytes:
        """One object of a version, whole; FileNotFoundError when it is not there."""
        key = f"{version_dirname(version)}/{name}"
        try:
            return bytes(obstore.get(self.objects, key).bytes())
        except _MISSING:
            raise FileNotFoundError(f"{self.root}/{key} is not there") from None

    def download(self, version: int, name: str, out: Path) -> str:
        """Stream one object of a version into the file `out`; returns its SHA-256 (FileNotFoundError: gone)."""
        key = f"{version_dirname(version)}/{name}"
        digest = hashlib.sha256()
        try:
            with open(out, "wb") as f:
                for chunk in obstore.get(self.objects, key).stream(min_chunk_size=8 << 20):
                    digest.update(chunk)
                    f.write(chunk)
        except _MISSING:
            out.unlink(missing_ok=True)
            raise FileNotFoundError(f"{self.root}/{key} is not there") from None
        return digest.hexdigest()

    def read_latest(self) -> tuple[int, str | None] | None:
        """(version, ETag) of LATEST, None when absent; WeightStoreError when it is not a version number."""
        try:
            result = obstore.get(self.objects, LATEST)
            text = bytes(result.bytes()).decode(errors="replace").strip()
        except _MISSING:
            return None
        if not text.isdigit():
            raise WeightStoreError(f"{self.root}/{LATEST} is corrupt: {text[:40]!r} is not a version number")
        return int(text), result.meta["e_tag"]

    def version_prefixes(self) -> list[int]:
        """The versions that have objects under their prefix (published or not: a version without its manifest is
        being written, or its publish died), ascending."""
        found = obstore.list_with_delimiter(self.objects)
        names = (_VERSION_PREFIX.fullmatch(p.rstrip("/") + "/") for p in found["common_prefixes"])
        return sorted(int(m.group(1)) for m in names if m)

    def keys(self, prefix: str) -> list[str]:
        """The keys of every object under `prefix` (relative to the store's prefix)."""
        return [meta["path"] for chunk in obstore.list(self.objects, prefix) for meta in chunk]

    # -- publishing (BucketWriter)
    def staging_from_json(self, data: bytes) -> Staging:
        """The staging another rank's `Staging.to_json` describes: the version's key prefix."""
        body = json.loads(data.decode())
        return Staging(version=int(body["version"]), dir=PurePosixPath(body["dir"]), stages=int(body["stages"]))

    def stage(self, version: int, stages: int) -> Staging | None:
        """Open `version` for per-stage publishing: the stages write under its prefix (module docstring). None when
        it is published already."""
        return self.writer.open_staging(version, stages)

    def write_stage(self, staging: Staging, stage: int, buckets: Iterable[dict[str, torch.Tensor]]) -> None:
        """Upload pipeline stage `stage`'s buckets under the version's prefix, then its `.stage-KK.json`; on failure
        `.stage-KK.failed` with the reason, and raises."""
        self.writer.write_stage(staging, stage, buckets)

    def publish(self, version: int, buckets: Iterable[dict[str, torch.Tensor]], hf_dir: str | os.PathLike | None,
                *, staging: Staging | None = None, wait_s: float = 120.0, adapter_config: dict | None = None) -> str:
        """Write one version (WeightStore.publish's contract, on S3: module docstring); returns its location."""
        return self.writer.publish(version, buckets, hf_dir, staging=staging, wait_s=wait_s,
                                   adapter_config=adapter_config)


class BucketWriter:
    """The bucket store's publishing part (the one writer of its prefix, module docstring): uploads stages and
    versions (every file, then the manifest) with their deltas from the tensors it wrote last (the delta base), moves
    LATEST forward by compare-and-swap and collects garbage. Its store's `stage`, `write_stage` and `publish` hand
    over to it; `full_every` and `max_delta_fraction`: when a shard gets a delta (BucketStore)."""

    def __init__(self, store: BucketStore, *, full_every: int, max_delta_fraction: float):
        self.store, self.objects = store, store.objects
        self.full_every, self.max_delta_fraction = full_every, max_delta_fraction
        self._base: tuple[int, dict[str, tuple[dict, dict]]] | None = None  # version, shard -> (tensors, entry)
        self._base_lock = threading.Lock()

    def open_staging(self, version: int, stages: int) -> Staging | None:
        check_stage_count(version, stages)
        if self.store.has(version):
            return None
        return Staging(version=version, dir=PurePosixPath(version_dirname(version)), stages=stages)

    def write_stage(self, staging: Staging, stage: int, buckets: Iterable[dict[str, torch.Tensor]]) -> None:
        check_stage(staging, stage)
        try:
            written = self._write_shards(staging.version, buckets, prefix=f"model-stage{stage:02d}")
            self._put(staging.version, stage_manifest(stage), json.dumps(
                {"version": staging.version, "stage": stage, "total_size": written.total_bytes,
                 "weight_map": written.weight_map, "files": written.files, "deltas": written.deltas}).encode())
        except BaseException as e:
            try:
                self._put(staging.version, stage_failed(stage), failure_reason(e).encode())
            except Exception:  # noqa: BLE001 - the bucket is unreachable: the publishing rank times out instead
                pass
            raise

    def publish(self, version: int, buckets: Iterable[dict[str, torch.Tensor]], hf_dir: str | os.PathLike | None,
                *, staging: Staging | None = None, wait_s: float = 120.0, adapter_config: dict | None = None) -> str:
        check_publish(version, staging, adapter_config)
        if staging is None and self.store.has(version):
            log.info("weight store: version %d already published at %s", version, self.store.location(version))
            self.advance_latest(version)
            return self.store.location(version)
        try:
            files, delta = self._write_version(version, buckets, hf_dir, staging, wait_s, adapter_config)
            manifest = manifest_body(version, files, ensure_lineage(self.store))
            if delta:
                manifest["delta"] = {"base": version - 1, "files": dict(sorted(delta.items()))}
            try:
                self._put(version, MANIFEST, (json.dumps(manifest, indent=1) + "\n").encode(), create=True)
            except AlreadyExistsError:
                log.warning("weight store: version %d was published meanwhile by another writer", version)
        except BaseException:
            if not self.store.has(version):
                self.delete_version(version, manifest_first=False)
            raise
        self.advance_latest(version)
        self._collect_garbage(version)
        return self.store.location(version)

    def advance_latest(self, version: int, tries: int = 50) -> None:
        """LATEST := version unless it names a newer one, by compare-and-swap (module docstring)."""
        for _ in range(tries):
            current = self.store.read_latest()
            if current is not None and current[0] >= version:
                return
            mode: PutMode = "create" if current is None else {"e_tag": current[1]}
            try:
                obstore.put(self.objects, LATEST, f"{version}\n".encode(), mode=mode, use_multipart=False)
                return
            except (AlreadyExistsError, PreconditionError):
                continue  # another writer moved it: read again
        raise WeightStoreError(f"{self.store.root}/{LATEST}: lost the compare-and-swap {tries} times in a row")

    def _write_version(self, version, buckets, hf_dir, staging, wait_s, adapter_config) -> tuple[dict, dict]:
        """Upload everything of `version` but its manifest; returns (file -> entry, shard -> delta entry)."""
        if adapter_config is not None:
            tensors = adapter_tensors(buckets)
            from safetensors.torch import save  # heavy: torch

            data = save(tensors, metadata={"format": "pt"})
            config = (json.dumps(adapter_config, indent=1) + "\n").encode()
            self._put(version, ADAPTER_FILE, data)
            self._put(version, ADAPTER_CONFIG, config)
            return {ADAPTER_FILE: bytes_entry(data), ADAPTER_CONFIG: bytes_entry(config)}, {}
        if staging is None:
            written = self._write_shards(version, buckets, prefix="model")
        else:
            self.write_stage(staging, 0, buckets)
            written = self._gather_stages(staging, wait_s)
        index = index_json(written.weight_map, written.total_bytes)
        files = dict(written.files)
        files[INDEX] = self._put(version, INDEX, index.encode())
        for item in model_files(hf_dir) if hf_dir is not None else []:
            files[item.name] = self._put(version, item.name, item.read_bytes())
        return files, written.deltas

    def _write_shards(self, version: int, buckets: Iterable[dict[str, torch.Tensor]], prefix: str) -> StageMerge:
        """One `<prefix>-NNNNN.safetensors` per non-empty bucket, uploaded `UPLOADS_IN_FLIGHT` at a time (the buckets
        are read in this thread: a trainer's gather is a collective), each with its delta when one is due."""
        base = self._delta_base(version)
        written = StageMerge()
        kept: dict[str, tuple[dict, dict]] = {}
        pending: list[Future] = []
        slots = threading.BoundedSemaphore(UPLOADS_IN_FLIGHT)  # shards in memory waiting for / in their upload
        with ThreadPoolExecutor(UPLOADS_IN_FLIGHT, thread_name_prefix="rft-upload") as pool:
            for i, bucket in enumerate(buckets):
                shard = f"{prefix}-{i:05d}.safetensors"
                tensors, size = shard_tensors(bucket, written.weight_map)
                written.total_bytes += size
                if not tensors:
                    continue
                written.weight_map.update(dict.fromkeys(tensors, shard))
                slots.acquire()
                pending.append(pool.submit(self._upload_shard, version, shard, tensors, base.get(shard)))
                pending[-1].add_done_callback(lambda _: slots.release())
            for future in pending:
                shard, entry, delta_entry, tensors = future.result()
                written.files[shard] = entry
                if delta_entry is not None:
                    written.deltas[shard] = delta_entry
                kept[shard] = (tensors, entry)
        if self.store.delta:
            with self._base_lock:  # the next version's base: what was written now (rebuilt by every version)
                self._base = (version, kept)
        return written

    def _delta_base(self, version: int) -> dict[str, tuple[dict, dict]]:
        """The shards (tensors, entry) of version - 1 when a delta against it is due for `version`, else {}."""
        with self._base_lock:
            base = self._base
        if not self.store.delta or base is None or base[0] != version - 1 or version % self.full_every == 0:
            return {}
        return base[1]

    def _upload_shard(self, version: int, shard: str, tensors: dict, base: tuple[dict, dict] | None):
        """Serialise, hash and upload one shard, and its delta from `base` when it is small enough; returns (shard,
        entry, delta entry or None, tensors)."""
        from safetensors.torch import save  # heavy: torch

        data = save(tensors, metadata={"format": "pt"})
        entry = self._put(version, shard, data)
        delta_entry = None
        if base is not None:
            encoded = deltas.encode(shard, base[0], tensors, base_sha256=base[1][CHECKSUM],
                                    new_header=deltas.header_bytes(data), new_size=len(data))
            if encoded is not None and len(encoded) < self.max_delta_fraction * len(data):
                delta_entry = self._put(version, shard + deltas.SUFFIX, encoded)
        return shard, entry, delta_entry, tensors

    def _gather_stages(self, staging: Staging, wait_s: float) -> StageMerge:
        """Every stage's `.stage-KK.json` merged (rft.weights.store.gather_stages: the first stage's is there
        already), then dropped; progress is a new object under the version's prefix."""
        def read(name: str) -> bytes | None:
            try:
                return self.store.read(staging.version, name)
            except FileNotFoundError:
                return None

        prefix = version_dirname(staging.version) + "/"
        merged = gather_stages(staging, wait_s, read=read, progress=lambda: len(self.store.keys(prefix)),
                               where=self.store.location(staging.version), reach="does it reach the bucket")
        obstore.delete(self.objects, [prefix + stage_manifest(s) for s in range(staging.stages)])
        return merged

    def _put(self, version: int, name: str, data: bytes, *, create: bool = False) -> dict:
        """Upload one object of a version (one PUT: a shard is at most sync.bucket_mb); returns its manifest entry."""
        obstore.put(self.objects, f"{version_dirname(version)}/{name}", data, use_multipart=False,
                    mode="create" if create else None)
        return bytes_entry(data)

    def _collect_garbage(self, published: int) -> None:
        """Keep the newest `keep` versions and LATEST's; drop versions below `published` that have no manifest."""
        latest = self.store.read_latest()
        prefixes = self.store.version_prefixes()
        visible = [v for v in prefixes if self.store.has(v)]
        doomed = [v for v in visible[:-self.store.keep] if latest is None or v != latest[0]]
        doomed += [v for v in prefixes if v < published and v not in visible]
        for v in doomed:
            self.delete_version(v, manifest_first=True)

    def delete_version(self, version: int, *, manifest_first: bool) -> None:
        prefix = version_dirname(version) + "/"
        if manifest_first:
            obstore.delete(self.objects, prefix + MANIFEST)
        keys = self.store.keys(prefix)
        for i in range(0, len(keys), 1000):
            obstore.delete(self.objects, keys[i:i + 1000])


def default_cache_dir() -> Path:
    """`$XDG_CACHE_HOME/rft/weights` (default `~/.cache/rft/weights`): where `sync.cache_dir` empty puts the cache."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "rft" / "weights"
