"""What `rft eval --checkpoint SPEC` evaluates. SPEC is one of:
- `initial`: `model.path`, step 0;
- `latest`: the newest weights of the run: the weight store's LATEST version (`sync.weight_store`, default
  `<run dir>/weights`; a bucket store's through this host's cache) or `<run dir>/final` (written by the trainer at
  the end), whichever has the later step (`final` on a tie, or when its step is unknown);
- a Hugging Face model directory; a weight store version `.../vNNNNNNNN` is step NNNNNNNN, the run's `final` is the
  step of the trainer's last checkpoint, any other directory has no step.

A weight store version (named, or what `latest` finds) is checked against its manifest before it is evaluated, as
explorers check what they load (`rft.weights.store.verify_version`; checksums with `sync.verify`): a truncated or
altered version is a CheckpointError naming the file, not a score of damaged weights.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from rft.models.config import ModelConfig
from rft.weights.store import WeightStoreError, is_adapter_version, verify_version, version_of

if TYPE_CHECKING:
    from rft.weights.stores import VersionStore


class CheckpointError(ValueError):
    pass


@dataclass(frozen=True)
class Checkpoint:
    label: str  # what the table and the metrics call it
    path: Path  # an HF model directory
    step: int | None  # the policy version, when known


def resolve_checkpoint(spec: str, model: ModelConfig, *, run_dir: Path, store: VersionStore | None,
                       checksums: bool = True) -> Checkpoint:
    """The checkpoint SPEC names (see the module docstring) for the run in `run_dir` (`<output_dir>/<run name>`),
    whose weight store is `store` (None: it has none yet; only read); a weight store version is verified against its
    manifest (`checksums`: SHA-256 too, not only sizes)."""
    if spec == "initial":
        return Checkpoint("initial", _model_dir(Path(model.path), "initial (model.path)"), 0)
    checkpoint = _latest(run_dir, store) if spec == "latest" else Checkpoint(
        spec, _model_dir(Path(spec), spec), _step_of(Path(spec), run_dir))
    version = version_of(checkpoint.path)
    if version is not None:
        try:
            verify_version(checkpoint.path, version, checksums=checksums)
        except (WeightStoreError, FileNotFoundError) as e:
            raise CheckpointError(f"--checkpoint {spec}: weight store version {version} does not match its "
                                  f"manifest, not evaluated: {e}") from None
    return checkpoint


def _model_dir(path: Path, spec: str) -> Path:
    if not (path / "config.json").is_file() and not is_adapter_version(path):
        raise CheckpointError(f"--checkpoint {spec}: {path} is not a Hugging Face model directory (no config.json) "
                              "nor a LoRA adapter version (adapter_config.json); give one, 'initial' or 'latest'")
    return path


def _step_of(path: Path, run_dir: Path) -> int | None:

    version = version_of(path)
    if version is not None:
        return version
    return _final_step(run_dir) if path.resolve() == (run_dir / "final").resolve() else None


def _final_step(run_dir: Path) -> int | None:
    """The step of the trainer's newest checkpoint (the trainer checkpoints its last step before writing final/)."""
    from rft.trainer.checkpoint import CheckpointDir  # heavy: torch

    checkpoints = CheckpointDir(run_dir)
    latest = checkpoints.latest()
    return checkpoints.read_state(latest).step if latest is not None else None


def _latest(run_dir: Path, store: VersionStore | None) -> Checkpoint:

    candidates = []
    found = store.latest() if store is not None else None
    if store is not None and found is not None:
        version, location = found
        try:
            path = store.local(version, checksums=False)  # checked with checksums by resolve_checkpoint
        except (WeightStoreError, FileNotFoundError) as e:
            raise CheckpointError(f"--checkpoint latest: weight store version {version} does not match its manifest, "
                                  f"not evaluated: {e} ({location})") from None
        candidates.append(Checkpoint(f"latest ({location})", path, version))
    final = run_dir / "final"
    if (final / "config.json").is_file():
        candidates.append(Checkpoint(f"latest ({final})", final, _final_step(run_dir)))
    if not candidates:
        raise CheckpointError(f"--checkpoint latest: run {run_dir.name!r} has no weights yet (no version in "
                              f"{store.root if store is not None else 'its weight store'}, no {final})")
    return max(candidates, key=lambda c: (math.inf if c.step is None else c.step, c.path == final))
