"""Versioned weights on a shared filesystem: the pull path of weight synchronisation (rft.weights).

Layout under `root`: `vNNNNNNNN/` (one published version: HF-layout safetensors shards, the index, config and
tokenizer files, and `rft-manifest.json` with every other file's size and SHA-256, written last) and `LATEST` (the
newest published version number). A LoRA run's version is a PEFT adapter directory plus the manifest.

Invariants (readers on other hosts rely on them):
- A `vNNNNNNNN/` directory is complete whenever it is visible: written under a temporary name, then renamed.
- `LATEST` only moves forward and always names a complete version (temporary file, `os.replace`, after the rename).
- Durable: a version directory and LATEST are put in place with `rft.processes.durable_replace` (contents fsynced,
  renamed, the root fsynced), so a power loss never leaves LATEST naming a version whose files are not there.
- Garbage collection keeps the newest `keep` versions (and LATEST's); a removed version is first renamed out of
  the namespace; a reader that loses the race gets FileNotFoundError and reads `latest()` again.
- Publishing a version that exists is a no-op returning its path (a resumed trainer re-publishes).
- Per-stage publishing (pipeline stages): `stage()` opens the temporary directory; each stage's publishing rank
  writes its shards and then `.stage-KK.json` (or `.stage-KK.failed`) with `write_stage`; `publish(..., staging=)`
  writes the first stage's shards, waits for every stage's manifest (an error names a stage without progress for
  `wait_s`), writes the index and renames. Every publishing rank must see `root` at the same path.
- `verify_version` checks a directory against its manifest before a distrusting reader loads it.
- Lineage (docs/security.md, "Weights that know their run"): `LINEAGE` (JSON: a random id, the run's name, when)
  is written once, conditionally, when a writer first uses the root (`claim_lineage`: the trainer; `ensure_lineage`:
  any other writer, before its first manifest). Every manifest carries the lineage id, the run and `checksum` (the
  SHA-256 of its file entries, `version_checksum`). A reader trusts the lineage it first reads (`LineagePin`) and
  refuses (LineageError) a version whose manifest names another lineage, and every version once LINEAGE names
  another. A trainer without a checkpoint of this lineage refuses a used root unless `sync.new_lineage`, which
  replaces LINEAGE and discards the old versions (`claim_lineage`).
One writer per root; any number of readers. `WeightStore` reads and hands `stage`, `write_stage` and `publish` to
its `DirectoryWriter`; the functions below are the format shared with the bucket store and the host cache.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path, PurePath
from typing import TYPE_CHECKING, Protocol

from rft.processes import durable_replace, sync_tree, write_durably
from rft.tensors import all_finite

if TYPE_CHECKING:
    import torch

    from rft.weights.config import SyncConfig

log = logging.getLogger(__name__)

LATEST = "LATEST"
LINEAGE = "LINEAGE"  # the store's incarnation (Lineage), written when a writer first uses the root
INDEX = "model.safetensors.index.json"
MANIFEST = "rft-manifest.json"
ADAPTER_FILE = "adapter_model.safetensors"  # a LoRA version's tensors (PEFT's layout)
ADAPTER_CONFIG = "adapter_config.json"  # ... and its PEFT config; its presence marks a version as an adapter
# the push path (rft.weights.push) sends an adapter version as this uint8 tensor (its adapter_config.json, UTF-8)
# first, then the adapter's tensors: what a receiver needs to write the PEFT directory (`save_pushed_adapter`)
PUSHED_ADAPTER_CONFIG = "rft.adapter_config.json"
CHECKSUM = "sha256"  # hashlib's: faster than blake2b on CPUs with SHA extensions (docs/benchmarks.md)
_VERSION_DIR = re.compile(r"v(\d{8})")
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf")
_WEIGHT_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")


class WeightStoreError(RuntimeError):
    pass


class LineageError(WeightStoreError):
    """A version, a store or a checkpoint of another lineage (another run, or an earlier start of the store)."""


@dataclass(frozen=True)
class Lineage:
    """A weight store's incarnation: `id` (32 hex digits, random), the `run` that started it, `created` (Unix time)."""
    id: str
    run: str
    created: float

    @classmethod
    def new(cls, run: str) -> Lineage:
        return cls(id=uuid.uuid4().hex, run=run, created=round(time.time(), 3))

    def to_json(self) -> str:
        return json.dumps({"id": self.id, "run": self.run, "created": self.created}) + "\n"

    @classmethod
    def from_json(cls, data: bytes | str, where: str) -> Lineage:
        """The lineage `data` holds; WeightStoreError naming `where` when it is not one."""
        try:
            body = json.loads(data)
            lineage = cls(id=body["id"], run=body["run"], created=float(body["created"]))
            if not (isinstance(lineage.id, str) and re.fullmatch(r"[0-9a-f]{32}", lineage.id)
                    and isinstance(lineage.run, str) and len(lineage.run) <= 256 and 0 <= lineage.created < 1e11):
                raise ValueError("id must be 32 hex digits, run a name and created a time")
        except (ValueError, KeyError, TypeError) as e:
            raise WeightStoreError(f"{where} is corrupt: {e}") from None
        return lineage

    def describe(self) -> str:
        when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(self.created))
        return f"lineage {self.id[:12]} (run {self.run!r}, started {when})"


class LineagePin:
    """The lineage one store object trusts: the one its writer claimed, else the first one it read. `expect(current)`
    is the lineage id a manifest must carry now (None: a store from before lineages, whose manifests carry none)."""

    def __init__(self) -> None:
        self.lineage: Lineage | None = None

    def expect(self, current: Lineage | None, where: str) -> str | None:
        if self.lineage is None:
            self.lineage = current
            return None if current is None else current.id
        if current is None or current.id != self.lineage.id:
            now = "gone" if current is None else f"now {current.describe()}"
            raise LineageError(f"{where}: the store's {LINEAGE} is {now}, not {self.lineage.describe()} that this "
                               f"process started with: another run took the store (sync.new_lineage); none of its "
                               f"versions is loaded here")
        return current.id


@dataclass(frozen=True)
class Staging:
    """A version that `stages` pipeline stages write into `dir`, a temporary directory in the store's root that
    the publishing rank created (`WeightStore.stage`). Travels to the other ranks as UTF-8 JSON (`to_json`)."""
    version: int
    dir: PurePath  # a directory (WeightStore), or a key prefix (BucketStore)
    stages: int

    def to_json(self) -> bytes:
        return json.dumps({"version": self.version, "dir": self.dir.name, "stages": self.stages}).encode()

    @classmethod
    def from_json(cls, root: str | os.PathLike, data: bytes) -> Staging:
        """The staging `to_json` describes, in the store at `root` (as this host sees it)."""
        body = json.loads(data.decode())
        return cls(version=int(body["version"]), dir=Path(root) / body["dir"], stages=int(body["stages"]))


def version_dirname(version: int) -> str:
    return f"v{version:08d}"


def version_of(path: str | os.PathLike) -> int | None:
    """The version a store directory `.../vNNNNNNNN` holds; None for any other path."""
    m = _VERSION_DIR.fullmatch(Path(path).name)
    return int(m.group(1)) if m else None


def iter_safetensors(path: str | os.PathLike) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every tensor of every `*.safetensors` file in `path`, files in name order.
    Tensors are read one at a time (memory stays at one tensor plus the page cache)."""
    from safetensors import safe_open

    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {path}")
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def store_root(sync: SyncConfig, run_dir: str | os.PathLike) -> Path:
    """Where a run's weight store is: `sync.weight_store`, default `<run dir>/weights` (not created here)."""
    return Path(sync.weight_store or Path(run_dir) / "weights")


class WeightStore:
    """See the module docstring. `keep` is the number of versions retained (>= 1). Two parts: this class reads
    (what is published, where, checked against its manifest) and `writer`, a DirectoryWriter, publishes; `stage`,
    `write_stage` and `publish` hand over to it."""
    delta = False  # publishes no sparse deltas (a bucket store may: rft.weights.bucket)

    def __init__(self, root: str | os.PathLike, *, keep: int = 2):
        if keep < 1:
            raise WeightStoreError(f"keep must be >= 1, got {keep}")
        self.root = Path(root)
        self.keep = keep
        self.root.mkdir(parents=True, exist_ok=True)
        self.writer = DirectoryWriter(self)
        self.pin = LineagePin()

    @classmethod
    def for_sync(cls, sync: SyncConfig, run_dir: str | os.PathLike) -> WeightStore:
        """The store `sync.weight_store` names (default `<run dir>/weights`), keeping `sync.keep_versions`."""
        return cls(store_root(sync, run_dir), keep=sync.keep_versions)

    # -- reading
    def path(self, version: int) -> Path:
        return self.root / version_dirname(version)

    def location(self, version: int) -> str:
        """What announcements carry for `version`: its directory."""
        return str(self.path(version))

    def has(self, version: int) -> bool:
        """Whether `version` is published (its directory is there: complete whenever visible)."""
        return self.path(version).is_dir()

    def local(self, version: int, location: str | os.PathLike | None = None, *, checksums: bool = True) -> Path:
        """The directory of `version` to load, checked against its manifest (`verify_version`; `checksums`: SHA-256
        too). `location`: where an announcement said it is; it must be this store's directory of that version once
        symlinks are resolved (`version_dir`), and a path that does not exist on this host names the same version in
        this store (the announcer may mount the store elsewhere). WeightStoreError when refused, FileNotFoundError
        when not there (not yet, or collected)."""
        path = self.path(version) if location is None else Path(location)
        if ".." not in path.parts and not path.exists():
            path = self.path(version)
        resolved = self.version_dir(path, version)
        expected = self.pin.expect(self.read_lineage(), str(self.root))
        verify_version(resolved, version, checksums=checksums)
        check_lineage(read_manifest(resolved), expected, str(resolved))
        return resolved

    # -- lineage (module docstring)
    def read_lineage(self) -> Lineage | None:
        """The root's LINEAGE, None when it has none; WeightStoreError when it is corrupt."""
        try:
            return Lineage.from_json((self.root / LINEAGE).read_text(), str(self.root / LINEAGE))
        except FileNotFoundError:
            return None

    def create_lineage(self, lineage: Lineage) -> bool:
        """Write LINEAGE unless there is one (atomically: linked into place); False when there was one."""
        tmp = self.root / f".{LINEAGE}.tmp-{uuid.uuid4().hex[:8]}"
        try:
            tmp.write_text(lineage.to_json())
            sync_tree(tmp)
            os.link(tmp, self.root / LINEAGE)
            sync_tree(self.root, recursive=False)
            return True
        except FileExistsError:
            return False
        finally:
            tmp.unlink(missing_ok=True)

    def replace_lineage(self, lineage: Lineage) -> None:
        """Start `lineage` here: LINEAGE replaced (readers refuse the old versions from now on), then LATEST and
        every version removed."""
        write_durably(self.root / LINEAGE, lineage.to_json())
        (self.root / LATEST).unlink(missing_ok=True)
        for version in self.versions():
            trash = self.root / f".trash-{version_dirname(version)}-{uuid.uuid4().hex[:8]}"
            os.rename(self.path(version), trash)
            shutil.rmtree(trash, ignore_errors=True)

    def version_dir(self, path: str | os.PathLike, version: int) -> Path:
        """`path` (a version directory named by someone else: a control-topic announcement) if it is this store's
        directory of `version` once symlinks are resolved; else WeightStoreError saying why (a `..` component, a
        path outside the store, a symlink out of it, another version's name). FileNotFoundError when the path is
        not there."""
        path = Path(path)
        if ".." in path.parts:
            raise WeightStoreError(f"{path}: a '..' component (only directories of the weight store {self.root} "
                                   f"are loaded)")
        resolved = path.resolve(strict=True)
        root = self.root.resolve(strict=True)
        if resolved.parent != root or resolved.name != version_dirname(version):
            raise WeightStoreError(f"{path} (resolved: {resolved}) is not version {version}'s directory "
                                   f"{version_dirname(version)} of the weight store {root}")
        return resolved

    def versions(self) -> list[int]:
        """Published versions present now, ascending."""
        found = (_VERSION_DIR.fullmatch(p.name) for p in self.root.iterdir() if p.is_dir())
        return sorted(int(m.group(1)) for m in found if m)

    def latest(self) -> tuple[int, Path] | None:
        """(version, path) that LATEST names, or None before the first publish."""
        try:
            text = (self.root / LATEST).read_text().strip()
        except FileNotFoundError:
            return None
        if not text.isdigit():
            raise WeightStoreError(f"{self.root / LATEST} is corrupt: {text[:40]!r} is not a version number")
        version = int(text)
        return version, self.path(version)

    def iter_tensors(self, version: int) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, tensor) of one published version, shard by shard."""
        path = self.path(version)
        if not path.is_dir():
            raise FileNotFoundError(f"weight store {self.root}: version {version} is not there "
                                    f"(present: {self.versions()})")
        return iter_safetensors(path)

    # -- publishing (DirectoryWriter)
    def staging_from_json(self, data: bytes) -> Staging:
        """The staging another rank's `Staging.to_json` describes, in this store (as this host sees it)."""
        return Staging.from_json(self.root, data)

    def stage(self, version: int, stages: int) -> Staging | None:
        """Open `version` for per-stage publishing by `stages` pipeline stages: creates its temporary directory.
        None when the version is published already (then `publish` without staging is a no-op)."""
        return self.writer.open_staging(version, stages)

    def write_stage(self, staging: Staging, stage: int, buckets: Iterable[dict[str, torch.Tensor]]) -> None:
        """Write pipeline stage `stage`'s buckets (one safetensors shard each) into `staging.dir`, then its
        manifest. On failure, leaves `.stage-KK.failed` with the reason for the publishing rank, and raises."""
        self.writer.write_stage(staging, stage, buckets)

    def publish(self, version: int, buckets: Iterable[dict[str, torch.Tensor]],
                hf_dir: str | os.PathLike | None, *, staging: Staging | None = None,
                wait_s: float = 120.0, adapter_config: dict | None = None) -> Path:
        """Write one version: each bucket (name -> tensor, HF names) becomes one safetensors shard; the
        non-weight files of `hf_dir` (config, tokenizer, generation config) are copied beside them.
        Returns the version's directory. A tensor name in two buckets (or two stages) is an error.

        With `staging` (from `stage`), `buckets` are the first pipeline stage's; the version is complete once
        every other stage's manifest is in (see the module docstring; `wait_s`: seconds without progress).
        `adapter_config` (a PEFT adapter_config.json as a dict): the version is that LoRA adapter, its tensors in one
        `adapter_model.safetensors` (no staging, no model files)."""
        return self.writer.publish(version, buckets, hf_dir, staging=staging, wait_s=wait_s,
                                   adapter_config=adapter_config)


def _local_dir(staging: Staging) -> Path:
    """A directory store's staging directory (`DirectoryWriter.open_staging` and `Staging.from_json` make it a Path)."""
    assert isinstance(staging.dir, Path), f"not a directory store's staging: {staging.dir!r}"
    return staging.dir


class DirectoryWriter:
    """The directory store's publishing part (the one writer of its root, module docstring: temporary directory,
    manifest, rename; then LATEST forward and garbage collection). Its store's `stage`, `write_stage` and `publish`
    hand over to it; their docstrings state the contracts."""

    def __init__(self, store: WeightStore):
        self.store = store

    def open_staging(self, version: int, stages: int) -> Staging | None:
        check_stage_count(version, stages)
        if self.store.path(version).exists():
            return None
        directory = self._temporary(version)
        directory.mkdir()
        return Staging(version=version, dir=directory, stages=stages)

    def write_stage(self, staging: Staging, stage: int, buckets: Iterable[dict[str, torch.Tensor]]) -> None:
        check_stage(staging, stage)
        directory = _local_dir(staging)
        if not directory.is_dir():
            raise WeightStoreError(f"version {staging.version}: the staging directory {directory} is not there: "
                                   f"every pipeline stage's publishing rank must see the weight store at the same "
                                   f"path (sync.weight_store on a shared filesystem)")
        try:
            weight_map, total = self._write_shards(directory, buckets, prefix=f"model-stage{stage:02d}")
            files = {shard: file_entry(directory / shard) for shard in sorted(set(weight_map.values()))}
            _write_atomically(directory / stage_manifest(stage), json.dumps(
                {"version": staging.version, "stage": stage, "total_size": total, "weight_map": weight_map,
                 "files": files}))
        except BaseException as e:
            try:
                _write_atomically(directory / stage_failed(stage), failure_reason(e))
            except OSError:
                pass  # the directory is gone: the publishing rank gave up on this version already
            raise

    def publish(self, version: int, buckets: Iterable[dict[str, torch.Tensor]],
                hf_dir: str | os.PathLike | None, *, staging: Staging | None = None,
                wait_s: float = 120.0, adapter_config: dict | None = None) -> Path:
        check_publish(version, staging, adapter_config)
        final = self.store.path(version)
        if staging is None and final.exists():
            log.info("weight store: version %d already published at %s", version, final)
            self._advance_latest(version)
            return final
        tmp = _local_dir(staging) if staging is not None else self._temporary(version)
        try:
            files: dict[str, dict] = {}
            if staging is None:
                tmp.mkdir()
            if adapter_config is not None:
                self._write_adapter(tmp, buckets, adapter_config)
            else:
                if staging is None:
                    weight_map, total_bytes = self._write_shards(tmp, buckets, prefix="model")
                else:
                    self.write_stage(staging, 0, buckets)
                    weight_map, total_bytes, files = self._gather_stages(staging, wait_s)
                (tmp / INDEX).write_text(index_json(weight_map, total_bytes))
                if hf_dir is not None:
                    self._copy_model_files(Path(hf_dir), tmp)
            self._write_manifest(tmp, version, files, ensure_lineage(self.store))
            durable_replace(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        self._advance_latest(version)
        self._collect_garbage()
        return final

    def _temporary(self, version: int) -> Path:
        return self.store.root / f".tmp-{version_dirname(version)}-{uuid.uuid4().hex[:8]}"

    @staticmethod
    def _write_shards(out: Path, buckets: Iterable[dict[str, torch.Tensor]],
                      prefix: str) -> tuple[dict[str, str], int]:
        """One `<prefix>-NNNNN.safetensors` per non-empty bucket; returns (tensor name -> file, total bytes)."""
        from safetensors.torch import save_file

        weight_map: dict[str, str] = {}
        total_bytes = 0
        for i, bucket in enumerate(buckets):
            shard = f"{prefix}-{i:05d}.safetensors"
            tensors, size = shard_tensors(bucket, weight_map)
            total_bytes += size
            if tensors:
                save_file(tensors, str(out / shard), metadata={"format": "pt"})
                weight_map.update(dict.fromkeys(tensors, shard))
        return weight_map, total_bytes

    @staticmethod
    def _write_adapter(out: Path, buckets: Iterable[dict[str, torch.Tensor]], adapter_config: dict) -> None:
        """PEFT's adapter directory: every tensor of `buckets` in ADAPTER_FILE, and ADAPTER_CONFIG."""
        from safetensors.torch import save_file

        save_file(adapter_tensors(buckets), str(out / ADAPTER_FILE), metadata={"format": "pt"})
        (out / ADAPTER_CONFIG).write_text(json.dumps(adapter_config, indent=1) + "\n")

    @staticmethod
    def _write_manifest(directory: Path, version: int, known: dict[str, dict], lineage: Lineage) -> None:
        """`MANIFEST` over every file in `directory`: the entries in `known` (shards that their pipeline stage
        hashed as it wrote them), the others hashed now; stamped with `lineage` (`manifest_body`)."""
        files = {}
        for item in sorted(directory.iterdir()):
            if item.name == MANIFEST or not item.is_file():
                continue
            files[item.name] = known.get(item.name) or file_entry(item)
        (directory / MANIFEST).write_text(json.dumps(manifest_body(version, files, lineage), indent=1) + "\n")

    @staticmethod
    def _gather_stages(staging: Staging, wait_s: float) -> tuple[dict[str, str], int, dict[str, dict]]:
        """Every stage's manifest merged (`gather_stages`); then the manifests are dropped. Returns (tensor name ->
        shard, total bytes, shard -> manifest entry)."""
        directory = _local_dir(staging)

        def read(name: str) -> bytes | None:
            try:
                return (directory / name).read_bytes()
            except FileNotFoundError:
                return None

        merged = gather_stages(staging, wait_s, read=read, progress=lambda: len(os.listdir(directory)),
                               where=str(directory), reach="does it see the weight store at the same path (a "
                                                           "shared filesystem)")
        for stage in range(staging.stages):
            (directory / stage_manifest(stage)).unlink()
        return merged.weight_map, merged.total_bytes, merged.files

    @staticmethod
    def _copy_model_files(hf_dir: Path, out: Path) -> None:
        for item in model_files(hf_dir):
            shutil.copy2(item, out / item.name)

    def _advance_latest(self, version: int) -> None:
        current = self.store.latest()
        if current is not None and current[0] >= version:
            return
        write_durably(self.store.root / LATEST, f"{version}\n")

    def _collect_garbage(self) -> None:
        latest = self.store.latest()
        versions = self.store.versions()
        doomed = [v for v in versions[:-self.store.keep] if latest is None or v != latest[0]]
        for v in doomed:
            trash = self.store.root / f".trash-{version_dirname(v)}-{uuid.uuid4().hex[:8]}"
            try:
                os.rename(self.store.path(v), trash)
            except FileNotFoundError:
                continue
            shutil.rmtree(trash, ignore_errors=True)


def is_adapter_version(path: str | os.PathLike) -> bool:
    """Whether a version directory holds a LoRA adapter (PEFT layout) rather than a model."""
    return (Path(path) / ADAPTER_CONFIG).is_file()


def read_adapter(path: str | os.PathLike) -> tuple[dict, dict[str, tuple[torch.Tensor, torch.Tensor]]]:
    """A PEFT adapter directory as (adapter_config, {HF module name: (A [r, in], B [out, r])}), module names without
    PEFT's `base_model.model.` prefix (`model.layers.0.self_attn.q_proj`). Each output adds alpha / r * B A x."""
    from safetensors.torch import load_file

    path = Path(path)
    config = json.loads((path / ADAPTER_CONFIG).read_text())
    tensors = load_file(str(path / ADAPTER_FILE))
    pairs: dict[str, tuple] = {}
    for name in tensors:
        if name.endswith(".lora_A.weight"):
            module = name.removesuffix(".lora_A.weight").removeprefix("base_model.model.")
            b = name.replace(".lora_A.", ".lora_B.")
            if b not in tensors:
                raise WeightStoreError(f"{path / ADAPTER_FILE}: {name} has no {b}")
            pairs[module] = (tensors[name], tensors[b])
    if not pairs:
        raise WeightStoreError(f"{path / ADAPTER_FILE}: no lora_A / lora_B tensors")
    return config, pairs


def pushed_adapter_bucket(adapter_config: dict) -> dict[str, torch.Tensor]:
    """The first bucket of a pushed adapter version: its adapter_config.json as a uint8 tensor."""
    import torch

    return {PUSHED_ADAPTER_CONFIG: torch.frombuffer(bytearray(json.dumps(adapter_config).encode()), dtype=torch.uint8)}


def save_pushed_adapter(first: tuple[str, torch.Tensor], rest: Iterable[tuple[str, torch.Tensor]],
                        out: str | os.PathLike) -> int:
    """Write a pushed adapter version (`first`: its PUSHED_ADAPTER_CONFIG tensor, `rest`: its tensors, read to the
    end) as a PEFT directory `out` (created; files written aside and renamed); returns the number of tensors."""
    from safetensors.torch import save_file

    name, config = first
    if name != PUSHED_ADAPTER_CONFIG:
        raise WeightStoreError(f"a pushed adapter starts with {PUSHED_ADAPTER_CONFIG}, not {name!r}")
    tensors = {n: t.detach().to("cpu").contiguous() for n, t in rest}
    if not tensors:
        raise WeightStoreError("the pushed adapter has no tensors")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / f".{ADAPTER_FILE}.tmp-{uuid.uuid4().hex[:8]}"
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    durable_replace(tmp, out / ADAPTER_FILE)
    _write_atomically(out / ADAPTER_CONFIG, bytes(config.tolist()).decode())
    return len(tensors)


def file_entry(path: Path) -> dict:
    """A file's manifest entry: {"size": bytes, CHECKSUM: hex digest}."""
    with open(path, "rb") as f:
        digest = hashlib.file_digest(f, CHECKSUM).hexdigest()
    return {"size": path.stat().st_size, CHECKSUM: digest}


def bytes_entry(data: bytes | memoryview) -> dict:
    """The manifest entry of a file whose contents are `data`."""
    return {"size": len(data), CHECKSUM: hashlib.new(CHECKSUM, data).hexdigest()}


def verify_version(path: str | os.PathLike, version: int, *, checksums: bool = True) -> None:
    """Check the version directory `path` against its manifest before loading it: the manifest is there and is
    for `version`; every file it names is a regular file inside `path` (no symlink) with its size and, with
    `checksums`, its checksum; no weight file is outside it. Raises WeightStoreError naming the first problem
    (FileNotFoundError when the directory itself is gone: garbage-collected, read LATEST again)."""
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"{path} is not there")
    try:
        manifest = json.loads((path / MANIFEST).read_text())
        files = manifest["files"]
        if not isinstance(files, dict) or manifest.get("algorithm") != CHECKSUM:
            raise ValueError(f"files must be a map and algorithm {CHECKSUM!r}")
    except FileNotFoundError:
        if not path.is_dir():
            raise
        raise WeightStoreError(f"{path}: no {MANIFEST} (every published version has one)") from None
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise WeightStoreError(f"{path / MANIFEST} is unreadable: {e}") from None
    if manifest.get("version") != version:
        raise WeightStoreError(f"{path / MANIFEST} is for version {manifest.get('version')}, not {version}")
    for item in path.iterdir():
        if item.name not in files and item.name != MANIFEST and (
                item.name.endswith(_WEIGHT_SUFFIXES) or item.name in _WEIGHT_INDEXES):
            raise WeightStoreError(f"{item} is not in the version's manifest")
    for name, entry in files.items():
        item = path / name
        if Path(name).name != name or item.is_symlink() or not item.is_file():
            raise WeightStoreError(f"{item}: not a regular file of the version directory (manifest entry {name!r})")
        size = item.stat().st_size
        if size != entry.get("size"):
            raise WeightStoreError(f"{item}: {size} bytes, the manifest says {entry.get('size')} (truncated or "
                                   f"rewritten)")
        if checksums and file_entry(item)[CHECKSUM] != entry.get(CHECKSUM):
            raise WeightStoreError(f"{item}: {CHECKSUM} does not match the manifest (corrupted or rewritten)")
    if checksums:
        bad = first_non_finite(iter_safetensors(path))
        if bad is not None:
            raise WeightStoreError(f"{path}: tensor {bad} holds NaN or infinity (a poisoned version is never loaded)")


def first_non_finite(tensors: Iterable[tuple[str, torch.Tensor]]) -> str | None:
    """The name of the first floating-point tensor of `tensors` ((name, tensor) pairs) holding a NaN or an
    infinity, else None. One tensor at a time."""
    for name, tensor in tensors:
        if tensor.is_floating_point() and not all_finite([tensor]):
            return name
    return None


def check_publish(version: int, staging: Staging | None, adapter_config: dict | None) -> None:
    """WeightStoreError when a publish's arguments do not go together (either store's `publish`)."""
    if adapter_config is not None and staging is not None:
        raise WeightStoreError(f"version {version}: a LoRA adapter is written whole by one rank, not per stage")
    if version < 0:
        raise WeightStoreError(f"version must be >= 0, got {version}")
    if staging is not None and staging.version != version:
        raise WeightStoreError(f"publish of version {version} got the staging of version {staging.version}")


def check_stage_count(version: int, stages: int) -> None:
    """WeightStoreError unless `version` may be opened for `stages` pipeline stages (either store's `stage`)."""
    if version < 0 or stages < 1:
        raise WeightStoreError(f"need version >= 0 and stages >= 1, got version {version}, stages {stages}")


def check_stage(staging: Staging, stage: int) -> None:
    """WeightStoreError unless `stage` is one of the stages of `staging` (either store's `write_stage`)."""
    if not 0 <= stage < staging.stages:
        raise WeightStoreError(f"stage {stage} is not one of the {staging.stages} stages of version "
                               f"{staging.version}")


def failure_reason(error: BaseException) -> str:
    """What a stage's failure marker (`stage_failed`) says: the error's type and message, at most 2000 characters."""
    return f"{type(error).__name__}: {error}"[:2000]


def shard_tensors(bucket: dict[str, torch.Tensor], written: dict[str, str]) -> tuple[dict[str, torch.Tensor], int]:
    """One bucket's tensors as a shard holds them (on the CPU, contiguous) and their bytes; WeightStoreError when a
    name is in `written` (tensor name -> shard: the buckets before) or twice in this one."""
    tensors: dict[str, torch.Tensor] = {}
    size = 0
    for name, tensor in bucket.items():
        if name in written or name in tensors:
            raise WeightStoreError(f"tensor {name!r} appears in more than one bucket")
        tensors[name] = tensor.detach().to("cpu").contiguous()
        size += tensors[name].numel() * tensors[name].element_size()
    return tensors, size


def index_json(weight_map: dict[str, str], total_bytes: int) -> str:
    """The text of a version's INDEX (tensor name -> shard, names sorted); WeightStoreError when it has no tensors."""
    if not weight_map:
        raise WeightStoreError("publish got no tensors")
    return json.dumps({"metadata": {"total_size": total_bytes}, "weight_map": dict(sorted(weight_map.items()))},
                      indent=1) + "\n"


def stage_manifest(stage: int) -> str:
    """The file (object) in which pipeline stage `stage` names its shards, written last (per-stage publishing)."""
    return f".stage-{stage:02d}.json"


def stage_failed(stage: int) -> str:
    """The file (object) in which pipeline stage `stage` leaves the reason it failed."""
    return f".stage-{stage:02d}.failed"


@dataclass
class StageMerge:
    """The stages' manifests merged (per-stage publishing): tensor name -> shard, total bytes, shard -> manifest
    entry, shard -> delta entry (bucket stores: rft.weights.bucket)."""
    weight_map: dict[str, str] = field(default_factory=dict)
    total_bytes: int = 0
    files: dict[str, dict] = field(default_factory=dict)
    deltas: dict[str, dict] = field(default_factory=dict)
    owner: dict[str, int] = field(default_factory=dict)

    def add(self, staging: Staging, stage: int, body: dict) -> None:
        """Merge stage `stage`'s manifest `body`; WeightStoreError when it is another version's or stage's, or names a
        tensor another stage has."""
        if (body["version"], body["stage"]) != (staging.version, stage):
            raise WeightStoreError(f"{stage_manifest(stage)} in {staging.dir} is for version {body['version']} stage "
                                   f"{body['stage']}, expected version {staging.version} stage {stage}")
        for name, shard in body["weight_map"].items():
            if name in self.owner:
                raise WeightStoreError(f"version {staging.version}: tensor {name!r} comes from pipeline stages "
                                       f"{self.owner[name]} and {stage}")
            self.owner[name], self.weight_map[name] = stage, shard
        self.total_bytes += int(body["total_size"])
        self.files.update(body.get("files", {}))
        self.deltas.update(body.get("deltas", {}))


def gather_stages(staging: Staging, wait_s: float, *, read: Callable[[str], bytes | None], progress: Callable[[], int],
                  where: str, reach: str) -> StageMerge:
    """Every stage's manifest merged, waiting for the others while any of them makes progress (`progress()`, the
    number of entries where they write, changes) at least every `wait_s` seconds. `read(name)`: a file's bytes, None
    when absent. A stage's failure marker, or `wait_s` without progress, is a WeightStoreError naming the stage
    (`where` it writes, `reach`: what to check)."""
    merged = StageMerge()
    pending = set(range(staging.stages))
    last, deadline, pause = -1, 0.0, 0.01
    while pending:
        for stage in sorted(pending):
            failed = read(stage_failed(stage))
            if failed is not None:
                raise WeightStoreError(f"version {staging.version}: pipeline stage {stage} failed to write its "
                                       f"shards: {failed.decode(errors='replace')}")
            body = read(stage_manifest(stage))
            if body is not None:
                merged.add(staging, stage, json.loads(body))
                pending.discard(stage)
        if not pending:
            break
        entries, now = progress(), time.monotonic()
        if entries != last:
            last, deadline = entries, now + wait_s
        elif now > deadline:
            raise WeightStoreError(
                f"version {staging.version}: pipeline stage(s) {', '.join(map(str, sorted(pending)))} wrote "
                f"nothing to {where} for {wait_s:g} s (sync.timeout_s): is the stage's publishing rank "
                f"alive, and {reach}?")
        time.sleep(pause)
        pause = min(pause * 2, 0.25)
    return merged


def model_files(hf_dir: str | os.PathLike) -> list[Path]:
    """The files of a Hugging Face model directory that go beside each version's weights (config, tokenizer,
    generation config: everything but weights, weight indexes and a weight store's manifest: `hf_dir` may be a
    version); WeightStoreError without a config.json."""
    hf_dir = Path(hf_dir)
    if not (hf_dir / "config.json").is_file():
        raise WeightStoreError(f"{hf_dir} has no config.json (hf_dir must be a Hugging Face model directory)")
    return sorted(item for item in hf_dir.iterdir() if item.is_file() and not item.name.endswith(_WEIGHT_SUFFIXES)
                  and item.name not in (*_WEIGHT_INDEXES, MANIFEST))


def adapter_tensors(buckets: Iterable[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Every tensor of `buckets` (a LoRA adapter version's, all in one file), on the CPU and contiguous."""
    tensors: dict[str, torch.Tensor] = {}
    for bucket in buckets:
        for name, tensor in bucket.items():
            if name in tensors:
                raise WeightStoreError(f"tensor {name!r} appears in more than one bucket")
            tensors[name] = tensor.detach().to("cpu").contiguous()
    if not tensors:
        raise WeightStoreError("publish got no adapter tensors")
    return tensors


def _write_atomically(path: Path, text: str) -> None:
    """`text` at `path`, visible whole or not at all, durably (rft.processes.write_durably)."""
    write_durably(path, text)


def version_checksum(files: dict) -> str:
    """A version's checksum: the SHA-256 of its manifest's file entries (name -> size and SHA-256), canonical JSON."""
    return hashlib.sha256(json.dumps(files, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def manifest_body(version: int, files: dict, lineage: Lineage) -> dict:
    """A version's manifest (either store): its files' entries, the lineage and the version's checksum."""
    return {"version": version, "algorithm": CHECKSUM, "files": dict(sorted(files.items())), "lineage": lineage.id,
            "run": lineage.run, "checksum": version_checksum(files)}


def read_manifest(path: str | os.PathLike) -> dict:
    """The manifest of the version directory `path` (a dict; WeightStoreError when unreadable)."""
    try:
        body = json.loads((Path(path) / MANIFEST).read_text())
    except (OSError, ValueError) as e:
        raise WeightStoreError(f"{Path(path) / MANIFEST} is unreadable: {e}") from None
    if not isinstance(body, dict):
        raise WeightStoreError(f"{Path(path) / MANIFEST} is not a JSON object")
    return body


def check_lineage(manifest: dict, expected: str | None, where: str) -> None:
    """LineageError unless `manifest` carries the lineage id `expected` (None: a store without LINEAGE, whose
    manifests carry none) and, when it has one, a `checksum` that matches its file entries."""
    found = manifest.get("lineage")
    if found != expected:
        raise LineageError(f"{where}: a version of lineage {str(found)[:12] if found else '(none)'} (run "
                           f"{manifest.get('run')!r}), the store's is {expected[:12] if expected else '(none)'}: "
                           f"another run's version (a reused store or a stale cache) is never loaded")
    checksum = manifest.get("checksum")
    if checksum is not None and checksum != version_checksum(manifest.get("files") or {}):
        raise WeightStoreError(f"{where}: the manifest's checksum does not match its files (rewritten)")


class LineageStore(Protocol):
    """What `claim_lineage` needs of a store (WeightStore, BucketStore)."""
    pin: LineagePin

    @property
    def root(self) -> Path | str: ...
    def read_lineage(self) -> Lineage | None: ...
    def create_lineage(self, lineage: Lineage) -> bool: ...
    def replace_lineage(self, lineage: Lineage) -> None: ...
    def latest(self) -> tuple[int, Path | str] | None: ...
    def versions(self) -> list[int]: ...


def claim_lineage(store: LineageStore, run: str, *, checkpoint: str | None, resumed: bool, resume: bool,
                  new: bool) -> Lineage:
    """The lineage the trainer of `run` publishes in (pinned on `store`): the store's, continued, when the checkpoint
    it resumed from (`resumed`) carries it (`checkpoint`: its id; "" or None for a checkpoint from before lineages),
    or when no checkpoint was there, `resume` was asked and the store is `run`'s (a restart before the first
    checkpoint); a new one, created, on an unused store or a store without LINEAGE resumed from a checkpoint without
    one (both from before lineages). Otherwise the store is used by another run or an earlier
    start: with `new` (sync.new_lineage) a new lineage replaces it (its versions are discarded), else LineageError
    saying what holds the store and how to go on."""
    current = store.read_lineage()
    unused = store.latest() is None and not store.versions()
    if current is None and (unused or (resumed and not checkpoint)):  # new; or a store and checkpoint from before
        lineage = Lineage.new(run)  # lineages, adopted (readers refuse its older versions, which carry none)
        if not store.create_lineage(lineage):
            raise LineageError(f"{store.root}: another writer started a lineage just now (one trainer per store)")
        store.pin.lineage = lineage
        return lineage
    if current is not None and (checkpoint == current.id or (resumed and not checkpoint and current.run == run)
                                or (not resumed and resume and current.run == run)):
        store.pin.lineage = current
        return current
    held = current.describe() if current is not None else "versions of an unknown lineage (no LINEAGE)"
    why = (f"the checkpoint is of lineage {checkpoint[:12]}" if resumed and checkpoint else
           "this trainer starts without a checkpoint (--no-resume, or none)" if not resumed else
           "the checkpoint predates lineages")
    if not new:
        raise LineageError(
            f"sync.weight_store {store.root} holds {held}, and {why}: this trainer cannot continue its versions. "
            f"Resume from that store's checkpoint, use another sync.weight_store, or set sync.new_lineage: true to "
            f"discard its versions and start a new lineage")
    lineage = Lineage.new(run)
    log.warning("weight store %s: %s, and %s; sync.new_lineage: starting %s (its versions are discarded)", store.root,
                held, why, lineage.describe())
    store.replace_lineage(lineage)
    store.pin.lineage = lineage
    return lineage


def ensure_lineage(store: LineageStore) -> Lineage:
    """The lineage a writer that claimed none stamps its versions with: the store's (pinned), else a new one."""
    if store.pin.lineage is None:
        current = store.read_lineage()
        if current is None:
            current = Lineage.new("")
            if not store.create_lineage(current):
                current = store.read_lineage() or current
        store.pin.lineage = current
    return store.pin.lineage
