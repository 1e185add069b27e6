"""Watching a run from `rft run`: until the run ends (`watch_run`) the parts are supervised (rft/cli/parts.py) and,
on every tick, a console line per trainer step is printed as metrics.jsonl grows (`MetricsProgress`, with a
progress bar and the time left; `monitor.progress`) and a stalled explorer fleet is reported (rft.ops.status
StallWatch). A run whose trainer finished lets its evaluator finish its last checkpoints (eval.finish_timeout_s);
the reward curve is drawn at the end (`plot_reward_curve`).
"""
from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

from rft.cli.parts import EVALUATOR, SERVER, PartRunner
from rft.observability.plots import plot_rewards
from rft.ops.status import StallWatch
from rft.run.config import Config


def watch_run(cfg: Config, runner: PartRunner, roles: tuple[str, ...]) -> int:
    """Supervise the started parts until the run ends (PartRunner.supervise: the trainer, else the explorers, decide;
    the online publisher and `rft serve` are essential); then, after a run that succeeded, stop every part but the
    evaluator and let it finish. The run's exit code."""
    metrics = cfg.run_dir / "metrics.jsonl"
    progress = MetricsProgress(metrics, cfg.run.max_steps) if cfg.monitor.progress else None
    watch = StallWatch(cfg, metrics) if "explorers" in roles else None
    code = runner.supervise(main_part="trainer" if "trainer" in roles else None,
                            on_tick=ticks(progress, watch), essential={"publisher", SERVER})
    if code == 0 and EVALUATOR in runner.parts:
        runner.stop_all(keep=(EVALUATOR,))
        runner.finish(EVALUATOR, timeout_s=cfg.eval.finish_timeout_s, on_tick=progress)
    return code


def ticks(*calls: Callable[[], None] | None) -> Callable[[], None] | None:
    """One supervision tick calling each of `calls` that is not None (None when none is)."""
    given = [c for c in calls if c is not None]
    if not given:
        return None

    def tick() -> None:
        for call in given:
            call()
    return tick


def plot_reward_curve(cfg: Config) -> None:
    """The reward curve of a finished run at `<run dir>/reward.png` (rft/observability/plots.py)."""
    metrics = cfg.run_dir / "metrics.jsonl"
    if metrics.exists():
        png = plot_rewards(metrics, cfg.run_dir / "reward.png", title=cfg.run.name)
        print(f"[rft] reward curve: {png}", flush=True)


class MetricsProgress:
    """Prints one console line per trainer step as metrics.jsonl grows, with a progress bar and the time left (the
    trainer's own log has more)."""

    def __init__(self, path: Path, max_steps: int):
        self.path, self.max_steps, self.offset = path, max_steps, 0
        self.started = time.time()
        self._first: tuple[int, float] | None = None

    def __call__(self) -> None:
        if not self.path.exists():
            return
        with open(self.path) as f:
            f.seek(self.offset)
            lines = f.readlines()
            if lines and not lines[-1].endswith("\n"):
                lines.pop()  # a line still being written
            self.offset += sum(len(line) for line in lines)
        for line in lines:
            m = json.loads(line)
            if "eval/checkpoint" in m:
                print(f"[rft] eval {m['eval/checkpoint']}: {_eval_summary(m)}", flush=True)
                continue
            print(f"[rft] step {m['step']:>4}/{self.max_steps} {self._bar(m['step'])}  "
                  f"reward {m.get('reward_mean', float('nan')):.3f}  loss {m.get('loss', float('nan')):+.4f}  "
                  f"staleness max {m.get('staleness_max', 0)}  dropped {m.get('dropped_stale', 0)}  "
                  f"{time.time() - self.started:6.0f} s{self._eta(m)}", flush=True)

    def _bar(self, step: int, width: int = 20) -> str:
        done = min(width, round(width * step / max(1, self.max_steps)))
        return "[" + "#" * done + "." * (width - done) + "]"

    def _eta(self, record: dict) -> str:
        """Remaining time at the pace of the steps this process has seen (a resume replays older lines first)."""
        if record.get("time", 0) < self.started:
            return ""
        if self._first is None:
            self._first = (record["step"], record["time"])
            return ""
        steps, seconds = record["step"] - self._first[0], record["time"] - self._first[1]
        if steps <= 0:
            return ""
        return f"  eta {seconds / steps * max(0, self.max_steps - record['step']):5.0f} s"


def _eval_summary(record: dict) -> str:
    """`<set>/accuracy 0.520  <set>/pass@4 0.830  <set>/mean@4 0.610 ...` from an evaluation's metrics record."""
    shown = ("accuracy", "pass@", "mean@")
    return "  ".join(f"{key.removeprefix('eval/')} {value:.3f}" for key, value in record.items()
                     if key.startswith("eval/") and key.rsplit("/", 1)[-1].startswith(shown))

