"""A host's cache of the versions of a bucket weight store (rft.weights.bucket): the explorers (and `rft serve`, the
evaluator) on one host share it, so each version crosses the network once per host, as a sparse delta when the
host has the version before it.

Layout under `directory` (one per store): `.lock` (fcntl: one process at a time builds or collects garbage),
`vNNNNNNNN/` (a complete, checked version and its manifest), `.tmp-vNNNNNNNN-XXXX/` (a version being built).
Contract:
- A `vNNNNNNNN/` directory is complete whenever it is visible: built aside, every file checked against the
  manifest's size and SHA-256 (with `checksums`, every floating-point tensor finite), then renamed into place.
- Each file of version v is (1) hard-linked from the newest cached version with the same name and SHA-256, else
  (2) rebuilt from the cached base and its delta (kept only if its SHA-256 matches), else (3) downloaded. A
  downloaded file that does not match refuses the version (WeightStoreError); a bad delta is counted
  (`stats["delta_fallbacks"]`), logged, and the file downloaded instead.
- `materialize` returns a complete version without locking when it is there (a short one is removed and rebuilt);
  otherwise it takes the lock, looks again and builds it: the explorers of a host fetch each version once.
- Lineage (rft.weights.store): `materialize(version, lineage=)` serves a cached version only when its manifest
  names `lineage`, the store's: a version another run left in the cache (the same store URL reused) is removed, counted
  (`stats["foreign_removed"]`, logged) and built again from the store; a store manifest of another lineage is refused
  (LineageError). Every cached version of another lineage is removed when the lock is taken.
- Garbage collection (under the lock, after each build) keeps the newest `keep` versions (>= 2: the newest is the
  next delta's base), renaming a doomed version out of the namespace first; a reader that loses the race gets
  FileNotFoundError and takes the newest version again (rft.weights.subscriber.load_newest_weights).
The directory must be on a local filesystem (flock over NFS is not dependable) every explorer of the host can write.
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import shutil
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Protocol

from rft.processes import durable_replace
from rft.weights import delta as deltas
from rft.weights.store import (
    CHECKSUM,
    MANIFEST,
    WeightStoreError,
    bytes_entry,
    check_lineage,
    file_entry,
    first_non_finite,
    iter_safetensors,
    version_dirname,
    version_of,
)

log = logging.getLogger(__name__)
LOCK = ".lock"
TRANSFERS = 4  # files fetched or rebuilt at once


class Source(Protocol):
    """Where versions come from (rft.weights.bucket.BucketStore)."""
    root: str

    def manifest(self, version: int) -> dict: ...  # FileNotFoundError when the version is not published
    def read(self, version: int, name: str) -> bytes: ...  # one object, whole; FileNotFoundError when absent
    def download(self, version: int, name: str, out: Path) -> str: ...  # into `out`; returns its SHA-256


class HostCache:
    """See the module docstring. `stats` counts this process's work: versions built, files downloaded / linked /
    rebuilt from deltas, delta fallbacks, bytes downloaded (full files and deltas)."""

    def __init__(self, directory: str | os.PathLike, source: Source, *, keep: int = 2):
        self.directory, self.source, self.keep = Path(directory), source, max(keep, 2)
        self.stats = dict.fromkeys(("versions_built", "files_downloaded", "files_linked", "deltas_applied",
                                    "delta_fallbacks", "bytes_downloaded", "delta_bytes", "foreign_removed"), 0)
        self._stats_lock = threading.Lock()

    def count(self, key: str, n: int = 1) -> None:
        with self._stats_lock:  # the transfer threads count too
            self.stats[key] += n

    def path(self, version: int) -> Path:
        return self.directory / version_dirname(version)

    def versions(self) -> list[int]:
        """Complete versions in the cache, ascending."""
        if not self.directory.is_dir():
            return []
        return sorted(v for p in self.directory.iterdir() if (v := version_of(p)) is not None)

    def materialize(self, version: int, *, checksums: bool = True, lineage: str | None = None) -> Path:
        """The cached, complete directory of `version` of `lineage` (the store's; None: a store without one), built
        first if needed (module docstring). FileNotFoundError when the store does not have it (not yet, or any more);
        LineageError when the store's version is of another lineage."""
        path = self.path(version)
        if self._whole(version, lineage):
            return path
        with self._locked():
            self._remove_foreign(lineage)
            if self._whole(version, lineage):  # another process built it while this one waited
                return path
            if path.exists():  # short files (a crash after the rename): out of the namespace first, then rebuilt
                os.rename(path, self.directory / f".trash-{version_dirname(version)}-{uuid.uuid4().hex[:8]}")
            self._remove_leftovers()
            started, before = time.monotonic(), dict(self.stats)
            self._build(version, path, checksums=checksums, lineage=lineage)
            self.count("versions_built")
            self._collect_garbage()
        done = {k: self.stats[k] - before[k] for k in self.stats}
        log.info("weights cache: version %d built in %.2f s (%d MB downloaded, %d deltas applied, %d fallbacks, "
                 "%d files linked)", version, time.monotonic() - started, done["bytes_downloaded"] // 10**6,
                 done["deltas_applied"], done["delta_fallbacks"], done["files_linked"])
        return path

    def _whole(self, version: int, lineage: str | None) -> bool:
        """Whether the cached `version` is there, of `lineage`, with every file of its manifest at its size (a stat
        each)."""
        path = self.path(version)
        manifest = self._cached_manifest(version)
        if manifest is None or manifest.get("lineage") != lineage:
            return False
        try:
            return all((path / name).stat().st_size == entry.get("size") for name, entry in manifest["files"].items())
        except (OSError, AttributeError, TypeError):
            return False

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        self.directory.mkdir(parents=True, exist_ok=True)
        with open(self.directory / LOCK, "a+") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)

    def _remove_foreign(self, lineage: str | None) -> None:
        """Remove (counted, logged) every cached version whose manifest names another lineage than `lineage`."""
        for version in self.versions():
            found = (self._cached_manifest(version) or {}).get("lineage")
            if found == lineage:
                continue
            log.warning("weights cache: version %d in %s is of lineage %s, not the store's %s (another run's, a stale "
                        "cache): removed, fetched again from the store when needed", version, self.directory,
                        str(found)[:12], str(lineage)[:12])
            trash = self.directory / f".trash-{version_dirname(version)}-{uuid.uuid4().hex[:8]}"
            os.rename(self.path(version), trash)
            shutil.rmtree(trash, ignore_errors=True)
            self.count("foreign_removed")

    def _build(self, version: int, path: Path, *, checksums: bool, lineage: str | None = None) -> None:
        manifest = self.source.manifest(version)
        check_lineage(manifest, lineage, f"{self.source.root} version {version}")
        tmp = self.directory / f".tmp-{version_dirname(version)}-{uuid.uuid4().hex[:8]}"
        tmp.mkdir()
        try:
            plan = _Plan(self, version, manifest)
            with ThreadPoolExecutor(TRANSFERS, thread_name_prefix="rft-cache") as pool:
                for future in [pool.submit(plan.fetch, name, entry, tmp) for name, entry in manifest["files"].items()]:
                    future.result()
            (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
            if checksums and any(tmp.glob("*.safetensors")):
                bad = first_non_finite(iter_safetensors(tmp))
                if bad is not None:
                    raise WeightStoreError(f"{self.source.root} version {version}: tensor {bad} holds NaN or infinity "
                                           "(a poisoned version is never loaded)")
            durable_replace(tmp, path)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise

    def _remove_leftovers(self) -> None:
        """Directories a killed builder or collector left (callers hold the lock, so none is in use)."""
        for item in self.directory.iterdir():
            if item.name.startswith((".tmp-", ".trash-")):
                shutil.rmtree(item, ignore_errors=True)

    def _collect_garbage(self) -> None:
        for version in self.versions()[:-self.keep]:
            trash = self.directory / f".trash-{version_dirname(version)}-{uuid.uuid4().hex[:8]}"
            os.rename(self.path(version), trash)
            shutil.rmtree(trash, ignore_errors=True)

    def _cached_manifest(self, version: int) -> dict | None:
        try:
            body = json.loads((self.path(version) / MANIFEST).read_text())
        except (OSError, ValueError):
            return None
        return body if isinstance(body, dict) else None


class _Plan:
    """How each file of one version is obtained (HostCache's module docstring: link, delta, download)."""

    def __init__(self, cache: HostCache, version: int, manifest: dict):
        self.cache, self.version = cache, version
        self.linkable: dict[tuple[str, str | None], Path] = {}  # (name, sha256) -> a cached file with that content
        for v in cache.versions():  # newest last: its files win
            cached = cache._cached_manifest(v)
            for name, entry in (cached or {}).get("files", {}).items():
                self.linkable[(name, entry.get(CHECKSUM))] = cache.path(v) / name
        delta = manifest.get("delta") or {}
        base = delta.get("base")
        self.base = cache._cached_manifest(base) if isinstance(base, int) and base in cache.versions() else None
        self.base_version = base
        self.deltas: dict = delta.get("files", {}) if self.base is not None else {}

    def fetch(self, name: str, entry: dict, out_dir: Path) -> None:
        if Path(name).name != name or name in ("", ".", "..", MANIFEST):
            raise WeightStoreError(f"{self.cache.source.root} version {self.version}: the manifest names a file "
                                   f"{name!r} (not a plain file name)")
        out = out_dir / name
        source = self.linkable.get((name, entry.get(CHECKSUM)))
        if source is not None:
            try:
                os.link(source, out)
                self.cache.count("files_linked")
                return
            except FileNotFoundError:
                pass  # collected meanwhile (only by this lock's holder, so not now): fetch it
        if name in self.deltas and self._from_delta(name, entry, out):
            return
        digest = self.cache.source.download(self.version, name, out)
        self.cache.count("files_downloaded")
        self.cache.count("bytes_downloaded", out.stat().st_size)
        if digest != entry.get(CHECKSUM) or out.stat().st_size != entry.get("size"):
            raise WeightStoreError(f"{self.cache.source.root} version {self.version}: {name} does not match the "
                                   f"manifest ({CHECKSUM} or size): corrupted or rewritten")

    def _from_delta(self, name: str, entry: dict, out: Path) -> bool:
        """Rebuild `name` from the base's copy and its delta; False (counted, logged) when that fails or differs."""
        base, base_version = self.base, self.base_version
        assert base is not None and isinstance(base_version, int)  # only a cached base's files have deltas planned
        base_entry = base.get("files", {}).get(name)
        try:
            if base_entry is None:
                raise deltas.DeltaError(f"version {base_version} has no {name}")
            data = self.cache.source.read(self.version, name + deltas.SUFFIX)
            self.cache.count("bytes_downloaded", len(data))
            self.cache.count("delta_bytes", len(data))
            if bytes_entry(data) != self.deltas[name]:
                raise deltas.DeltaError("the delta does not match its manifest entry")
            deltas.apply(data, self.cache.path(base_version) / name, out, base_sha256=base_entry[CHECKSUM])
            if file_entry(out) != {"size": entry.get("size"), CHECKSUM: entry.get(CHECKSUM)}:
                out.unlink()
                raise deltas.DeltaError("the rebuilt file does not match the manifest")
        except (deltas.DeltaError, FileNotFoundError, OSError) as e:
            self.cache.count("delta_fallbacks")
            log.warning("weights cache: version %d: %s from the delta failed, downloading it whole: %s", self.version,
                        name, e)
            return False
        self.cache.count("deltas_applied")
        return True

