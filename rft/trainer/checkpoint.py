"""Trainer checkpoints: model + optimizer (megatron dist checkpoint, through the policy), and the trainer state
(step = policy version, the feed's Kafka offsets and taken group ids, RNG states, the replay buffer's candidates)
as JSON.

Layout: `<run dir>/checkpoints/step_000012/{model/, trainer_state.json}` and `<run dir>/checkpoints/latest`, a
text file holding the directory name of the newest *complete* checkpoint. `latest` is replaced atomically after
everything else is written, so a crash mid-save leaves the previous checkpoint in force: the records consumed
since then are consumed again, exactly once, by the restarted trainer. Both files are put in place durably
(`rft.processes.write_durably`: fsync of the file, the rename, the directory), after the step's model files were
synced (`sync_tree`, by the trainer), so a power loss never leaves `latest` naming a checkpoint that is not there.
"""
from __future__ import annotations

import json
import os
import random
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from rft.processes import write_durably
from rft.trainer.feed import FeedState


@dataclass
class TrainerState:
    step: int
    feed: FeedState
    counters: dict[str, float]
    rng: dict
    replay_buffer: dict = field(default_factory=dict)  # ReplayBuffer.to_json(); empty without replay
    demonstrations: dict = field(default_factory=dict)  # the demonstrations feed's FeedState.to_json(); {} without one
    lineage: str = ""  # the weight store's lineage id the versions up to `step` were published in ("": none, or older)


def capture_rng() -> dict:
    state = random.getstate()
    return {"python": [state[0], list(state[1]), state[2]],
            "numpy": _numpy_rng_json(np.random.get_state()),
            "torch": torch.get_rng_state().tolist()}


def restore_rng(rng: dict) -> None:
    version, internal, gauss = rng["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = rng["numpy"]
    np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(torch.tensor(rng["torch"], dtype=torch.uint8))


def _numpy_rng_json(state) -> list:
    name, keys, pos, has_gauss, cached = state
    return [name, keys.tolist(), int(pos), int(has_gauss), float(cached)]


class CheckpointDir:
    def __init__(self, run_dir: str | os.PathLike, *, keep: int = 2):
        self.root = Path(run_dir) / "checkpoints"
        self.keep = keep

    def step_dir(self, step: int) -> Path:
        return self.root / f"step_{step:06d}"

    def latest(self) -> Path | None:
        pointer = self.root / "latest"
        if not pointer.is_file():
            return None
        path = self.root / pointer.read_text().strip()
        if not (path / "trainer_state.json").is_file():
            raise RuntimeError(f"{pointer} names {path}, which is not a complete checkpoint")
        return path

    def read_state(self, path: Path) -> TrainerState:
        data = json.loads((path / "trainer_state.json").read_text())
        return TrainerState(step=int(data["step"]), feed=FeedState.from_json(data["feed"]),
                            counters=data.get("counters", {}), rng=data["rng"],
                            replay_buffer=data.get("replay_buffer", {}),
                            demonstrations=data.get("demonstrations", {}), lineage=str(data.get("lineage", "")))

    def write_state(self, path: Path, state: TrainerState) -> None:
        body = {"step": state.step, "policy_version": state.step, "feed": state.feed.to_json(),
                "counters": state.counters, "rng": state.rng, "replay_buffer": state.replay_buffer,
                "demonstrations": state.demonstrations, "lineage": state.lineage}
        write_durably(path / "trainer_state.json", json.dumps(body))

    def commit(self, step: int) -> None:
        """Make step's checkpoint the latest (atomic), then drop old ones."""
        write_durably(self.root / "latest", self.step_dir(step).name + "\n")
        complete = sorted(p for p in self.root.glob("step_*") if (p / "trainer_state.json").is_file())
        for old in complete[:-self.keep]:
            shutil.rmtree(old, ignore_errors=True)
