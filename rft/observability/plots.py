"""The reward curve of a run: mean reward against step and against wall-clock time, as a PNG (matplotlib, imported
when called), from the run's metrics JSONL (`read_metrics`), with each eval set's held-out accuracy when the run has
them. `rft run` draws it at `<run dir>/reward.png` after the trainer finished."""
from __future__ import annotations

import os
from pathlib import Path

from rft.observability.metrics import read_metrics


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
