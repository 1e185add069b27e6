"""What `rft eval --checkpoint SPEC` evaluates. SPEC is one of:
- `initial`: `model.path`, step 0;
- `latest`: the newest weights of the run: the weight store's LATEST version (`sync.weight_store`, default
  `<run dir>/weights`) or `<run dir>/final` (written by the trainer at the end), whichever has the later step
  (`final` on a tie, or when its step is unknown);
- a Hugging Face model directory; a weight store version `.../vNNNNNNNN` is step NNNNNNNN, the run's `final` is the
  step of the trainer's last checkpoint, any other directory has no step.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from rft.config import Config


class CheckpointError(ValueError):
    pass


@dataclass(frozen=True)
class Checkpoint:
    label: str  # what the table and the metrics call it
    path: Path  # an HF model directory
    step: int | None  # the policy version, when known


def resolve_checkpoint(spec: str, cfg: Config) -> Checkpoint:
    if spec == "initial":
        return Checkpoint("initial", _model_dir(Path(cfg.model.path), "initial (model.path)"), 0)
    if spec == "latest":
        return _latest(cfg)
    path = _model_dir(Path(spec), spec)
    return Checkpoint(spec, path, _step_of(path, cfg))


def _model_dir(path: Path, spec: str) -> Path:
    if not (path / "config.json").is_file():
        raise CheckpointError(f"--checkpoint {spec}: {path} is not a Hugging Face model directory (no config.json); "
                              "give a model directory, 'initial' or 'latest'")
    return path


def _step_of(path: Path, cfg: Config) -> int | None:
    from rft.weights.store import version_of

    version = version_of(path)
    if version is not None:
        return version
    return _final_step(cfg) if path.resolve() == (cfg.run_dir / "final").resolve() else None


def _final_step(cfg: Config) -> int | None:
    """The step of the trainer's newest checkpoint (the trainer checkpoints its last step before writing final/)."""
    from rft.trainer.checkpoint import CheckpointDir

    checkpoints = CheckpointDir(cfg.run_dir)
    latest = checkpoints.latest()
    return checkpoints.read_state(latest).step if latest is not None else None


def _latest(cfg: Config) -> Checkpoint:
    from rft.weights.store import LATEST, WeightStore

    candidates = []
    store_root = Path(cfg.sync.weight_store or cfg.run_dir / "weights")
    if (store_root / LATEST).is_file():
        version, path = WeightStore(store_root).latest()
        candidates.append(Checkpoint(f"latest ({path})", path, version))
    final = cfg.run_dir / "final"
    if (final / "config.json").is_file():
        candidates.append(Checkpoint(f"latest ({final})", final, _final_step(cfg)))
    if not candidates:
        raise CheckpointError(f"--checkpoint latest: run {cfg.run.name!r} has no weights yet (no {store_root / LATEST}, "
                              f"no {final})")
    return max(candidates, key=lambda c: (math.inf if c.step is None else c.step, c.path == final))
