"""Metrics: one JSON object per line in `<run dir>/<name>.jsonl` always; TensorBoard and W&B when configured
(W&B in offline mode unless WANDB_MODE says otherwise); a reward curve PNG from the JSONL."""
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


def plot_rewards(metrics_path: str | os.PathLike, out_png: str | os.PathLike, *, title: str = "") -> Path:
    """Mean reward against step and against wall-clock time, as a PNG, with each eval set's held-out accuracy
    (`eval/<set>/accuracy` records of the periodic evaluator) on the same axes when the run has them."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    all_records = read_metrics(metrics_path)
    records = [r for r in all_records if r.get("reward_mean") is not None]
    if not records:
        raise ValueError(f"{metrics_path}: no step has a reward_mean to plot")
    start = min(r["time"] for r in all_records if "time" in r)
    minutes = lambda rs: [(r["time"] - start) / 60 for r in rs]  # noqa: E731
    fig, (by_step, by_time) = plt.subplots(1, 2, figsize=(10, 4))
    by_step.plot([r["step"] for r in records], [r["reward_mean"] for r in records], marker=".", label="mean reward")
    by_time.plot(minutes(records), [r["reward_mean"] for r in records], marker=".", label="mean reward")
    for name, evals in _eval_accuracies(all_records).items():
        label = f"held-out accuracy ({name})"
        by_step.plot([r["step"] for r in evals], [r[f"eval/{name}/accuracy"] for r in evals], marker="s", label=label)
        by_time.plot(minutes(evals), [r[f"eval/{name}/accuracy"] for r in evals], marker="s", label=label)
    by_step.set(xlabel="step (policy version)", ylabel="reward / accuracy", title="by step")
    by_time.set(xlabel="wall-clock (minutes)", ylabel="reward / accuracy", title="by time")
    for ax in (by_step, by_time):
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    out = Path(out_png)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def _eval_accuracies(records: list[dict]) -> dict[str, list[dict]]:
    """{eval set: its evaluation records in order} from `eval/<set>/accuracy` keys."""
    sets: dict[str, list[dict]] = {}
    for r in records:
        for key in r:
            if key.startswith("eval/") and key.endswith("/accuracy") and "time" in r:
                sets.setdefault(key[len("eval/"):-len("/accuracy")], []).append(r)
    return sets


# --------------------------------------------------------------------------------------------------
# Prometheus


class MetricsEndpoint:
    """A Prometheus scrape endpoint (`/metrics`) serving the latest values given to `update`. Names ending in
    `_total` are exposed as counters (the caller passes running totals), everything else as gauges; every
    series carries the labels given at start (run, role, id)."""

    def __init__(self, port: int, *, labels: dict[str, str], host: str = "127.0.0.1", search: int = 1):
        """Serve on `host` (monitor.prometheus_host), on the first free port of `port .. port + search - 1`
        (explorers sharing a host search)."""
        from prometheus_client import CollectorRegistry, start_http_server

        self.labels = labels
        self._values: dict[str, tuple[float, str]] = {}
        registry = CollectorRegistry(auto_describe=False)
        registry.register(self)
        last_error: OSError | None = None
        for candidate in range(port, port + max(1, search)):
            try:
                self._server, self._thread = start_http_server(candidate, addr=host, registry=registry)
                self.port = candidate
                return
            except OSError as e:
                last_error = e
        raise OSError(f"no free port for the Prometheus endpoint in {port}..{port + search - 1}: {last_error}")

    def update(self, values: dict[str, float], help_text: dict[str, str] | None = None) -> None:
        for name, value in values.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
                self._values[name] = (float(value), (help_text or {}).get(name, name.replace("_", " ")))

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        names, values = list(self.labels), list(self.labels.values())
        for name, (value, text) in sorted(self._values.items()):
            family = (CounterMetricFamily(name.removesuffix("_total"), text, labels=names) if name.endswith("_total")
                      else GaugeMetricFamily(name, text, labels=names))
            family.add_metric(values, value)
            yield family

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


PORT_SEARCH = 64


def metrics_endpoint(monitor: MonitorConfig, *, run: str, role: str, instance: str) -> MetricsEndpoint | None:
    """The endpoint `monitor.prometheus_port` asks for (None when it is 0), on `monitor.prometheus_host`, on the first
    free port of the PORT_SEARCH from there (the parts of a run may share a host), labelled with the run's name, the part's role
    and its instance. Each part announces the port it took on the control topic, and `rft status` lists them."""
    if not monitor.prometheus_port:
        return None
    return MetricsEndpoint(monitor.prometheus_port, host=monitor.prometheus_host, search=PORT_SEARCH,
                           labels={"run": run, "role": role, "instance": instance})
