"""A part's metrics log: one JSON object per line in `<run dir>/<name>.jsonl` always (appended to, never truncated:
safe across restarts; non-finite floats written as null); TensorBoard and W&B when configured (W&B in offline mode
unless WANDB_MODE says otherwise). `read_metrics` reads a JSONL back, one record per step. The other sinks: the
Prometheus endpoint (rft/observability/prometheus.py) and the reward curve PNG (rft/observability/plots.py)."""
from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Any

from rft.observability.config import MonitorConfig


def _jsonable(value: Any) -> Any:
    if hasattr(value, "item") and getattr(value, "ndim", 1) == 0:
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value


class MetricsLogger:
    """Appends metrics; safe to reopen after a restart (the file is appended to, never truncated)."""

    def __init__(self, run_dir: str | os.PathLike, cfg: MonitorConfig, *, name: str = "metrics",
                 run_name: str = "rft"):
        self.path = Path(run_dir) / f"{name}.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "a", buffering=1)
        self._tb = self._wandb = None
        if cfg.tensorboard:
            from torch.utils.tensorboard import SummaryWriter
            self._tb = SummaryWriter(str(Path(run_dir) / "tensorboard"))
        if cfg.wandb:
            import wandb
            os.environ.setdefault("WANDB_MODE", "offline")
            self._wandb = wandb.init(project=cfg.wandb_project, name=run_name, dir=str(run_dir), resume="allow")

    def log(self, metrics: dict[str, Any], step: int | None = None) -> None:
        record = _jsonable({"time": time.time(), **metrics})
        self._file.write(json.dumps(record) + "\n")
        scalars = {k: v for k, v in record.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        step = step if step is not None else record.get("step")
        if self._tb is not None:
            for k, v in scalars.items():
                self._tb.add_scalar(k, v, step)
        if self._wandb is not None:
            self._wandb.log(scalars, step=step)

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


def read_metrics(path: str | os.PathLike) -> list[dict[str, Any]]:
    """Metrics lines, one record per step: the lines of a step (the trainer's, an evaluation's; after a resume a step
    may appear twice) are merged, later values winning, except `time`, which stays the step's first."""
    by_step: dict[Any, dict] = {}
    lines = []
    for line in Path(path).read_text().splitlines():
        if line.strip():
            record = json.loads(line)
            if "step" in record:
                merged = by_step.setdefault(record["step"], {})
                merged.update({k: v for k, v in record.items() if k != "time" or "time" not in merged})
            else:
                lines.append(record)
    return [by_step[s] for s in sorted(by_step)] + lines
