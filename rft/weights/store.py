"""Versioned weights on a shared filesystem: the pull path of weight synchronisation (rft.weights).

Layout under `root`:
    v00000003/              one published version: HF-layout safetensors shards + the model's
        model-00000.safetensors ...   config / tokenizer files, so each version is a loadable HF model
        model.safetensors.index.json
        config.json, tokenizer.json, ...
    LATEST                  text: the newest published version number

Invariants (readers on other hosts rely on them):
- A `vNNNNNNNN/` directory is complete whenever it is visible: it is written under a temporary name
  in `root` and renamed into place (rename is atomic within one filesystem).
- `LATEST` only moves forward and always names a complete version: it is written to a temporary
  file and `os.replace`d, after the version directory is in place.
- Garbage collection keeps the newest `keep` versions (and whatever LATEST names); a version being
  removed is first renamed out of the `vNNNNNNNN` namespace, so a reader sees it whole or not at all.
  A reader that loses the race gets FileNotFoundError and should read `latest()` again.
- Publishing a version that exists already is a no-op returning its path (a trainer resuming from a
  checkpoint re-publishes the same weights under the same number).
Single writer per root (the trainer's publishing rank); any number of readers.
"""
from __future__ import annotations

import json
import logging
import os
import re
import shutil
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Iterable, Iterator

if TYPE_CHECKING:
    import torch

    from rft.config import SyncConfig

log = logging.getLogger(__name__)

LATEST = "LATEST"
INDEX = "model.safetensors.index.json"
_VERSION_DIR = re.compile(r"v(\d{8})")
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf")
_WEIGHT_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")


class WeightStoreError(RuntimeError):
    pass


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


def store_root(sync: "SyncConfig", run_dir: str | os.PathLike) -> Path:
    """Where a run's weight store is: `sync.weight_store`, default `<run dir>/weights` (not created here)."""
    return Path(sync.weight_store or Path(run_dir) / "weights")


class WeightStore:
    """See the module docstring. `keep` is the number of versions retained (>= 1)."""

    def __init__(self, root: str | os.PathLike, *, keep: int = 2):
        if keep < 1:
            raise WeightStoreError(f"keep must be >= 1, got {keep}")
        self.root = Path(root)
        self.keep = keep
        self.root.mkdir(parents=True, exist_ok=True)

    @classmethod
    def for_sync(cls, sync: "SyncConfig", run_dir: str | os.PathLike) -> "WeightStore":
        """The store `sync.weight_store` names (default `<run dir>/weights`), keeping `sync.keep_versions`."""
        return cls(store_root(sync, run_dir), keep=sync.keep_versions)

    def path(self, version: int) -> Path:
        return self.root / version_dirname(version)

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

    def publish(self, version: int, buckets: Iterable[dict[str, torch.Tensor]],
                hf_dir: str | os.PathLike | None) -> Path:
        """Write one version: each bucket (name -> tensor, HF names) becomes one safetensors shard; the
        non-weight files of `hf_dir` (config, tokenizer, generation config) are copied beside them.
        Returns the version's directory. A tensor name in two buckets is an error."""
        if version < 0:
            raise WeightStoreError(f"version must be >= 0, got {version}")
        final = self.path(version)
        if final.exists():
            log.info("weight store: version %d already published at %s", version, final)
            self._advance_latest(version)
            return final
        tmp = self.root / f".tmp-{version_dirname(version)}-{uuid.uuid4().hex[:8]}"
        tmp.mkdir()
        try:
            self._write_shards(tmp, buckets)
            if hf_dir is not None:
                self._copy_model_files(Path(hf_dir), tmp)
            os.rename(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        self._advance_latest(version)
        self._collect_garbage()
        return final

    def _write_shards(self, out: Path, buckets: Iterable[dict[str, torch.Tensor]]) -> None:
        from safetensors.torch import save_file

        weight_map: dict[str, str] = {}
        total_bytes = 0
        for i, bucket in enumerate(buckets):
            shard = f"model-{i:05d}.safetensors"
            tensors = {}
            for name, tensor in bucket.items():
                if name in weight_map or name in tensors:
                    raise WeightStoreError(f"tensor {name!r} appears in more than one bucket")
                tensors[name] = tensor.detach().to("cpu").contiguous()
                total_bytes += tensors[name].numel() * tensors[name].element_size()
            if tensors:
                save_file(tensors, str(out / shard), metadata={"format": "pt"})
                weight_map.update(dict.fromkeys(tensors, shard))
        if not weight_map:
            raise WeightStoreError("publish got no tensors")
        index = {"metadata": {"total_size": total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
        (out / INDEX).write_text(json.dumps(index, indent=1) + "\n")

    @staticmethod
    def _copy_model_files(hf_dir: Path, out: Path) -> None:
        if not (hf_dir / "config.json").is_file():
            raise WeightStoreError(f"{hf_dir} has no config.json (hf_dir must be a Hugging Face model directory)")
        for item in hf_dir.iterdir():
            if item.is_file() and not item.name.endswith(_WEIGHT_SUFFIXES) and item.name not in _WEIGHT_INDEXES:
                shutil.copy2(item, out / item.name)

    def _advance_latest(self, version: int) -> None:
        current = self.latest()
        if current is not None and current[0] >= version:
            return
        tmp = self.root / f".{LATEST}.tmp-{uuid.uuid4().hex[:8]}"
        tmp.write_text(f"{version}\n")
        os.replace(tmp, self.root / LATEST)

    def _collect_garbage(self) -> None:
        latest = self.latest()
        versions = self.versions()
        doomed = [v for v in versions[:-self.keep] if latest is None or v != latest[0]]
        for v in doomed:
            trash = self.root / f".trash-{version_dirname(v)}-{uuid.uuid4().hex[:8]}"
            try:
                os.rename(self.path(v), trash)
            except FileNotFoundError:
                continue
            shutil.rmtree(trash, ignore_errors=True)

    def iter_tensors(self, version: int) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, tensor) of one published version, shard by shard."""
        path = self.path(version)
        if not path.is_dir():
            raise FileNotFoundError(f"weight store {self.root}: version {version} is not there "
                                    f"(present: {self.versions()})")
        return iter_safetensors(path)
