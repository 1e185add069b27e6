"""`rft eval CONFIG`: evaluate weights on the task sets of `eval.sets` with the explorer's stack (engine, workflow,
reward); no trainer, no broker.

    rft eval CONFIG --checkpoint initial --checkpoint runs/NAME/final    # the named checkpoints, in order
    rft eval CONFIG --follow                                             # the versions a live run publishes

Tasks are built as the task publisher builds them (rft/data/tasks.py), each sampled `eval.n_samples` times with
eval's sampling settings and scored by the set's reward; metrics: rft/evaluation/metrics.py. One engine serves all
checkpoints (loading each in place), so they must share the architecture. Every evaluation appends one record to
`<run dir>/metrics.jsonl`: `step` (when known), `eval/checkpoint`, `eval/<set>/accuracy`, `pass@<k>`, `mean@<k>`,
`tasks`, `errors`. `--checkpoint` prints a table at the end.

`--follow` is periodic evaluation in a live run (`eval.every_steps: N`, `rft run`'s `evaluator` part): its own
process reading the weight store, so the trainer never waits. It evaluates versions 0, N, 2N, ...; a due version
already garbage-collected is replaced by the newest (the record carries that version as its step). SIGUSR1 (sent
once the trainer finished) evaluates the newest version, unless done, and exits; SIGTERM / Ctrl-C stop it after the
evaluation in progress (a second one aborts).
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import logging
import signal
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from rft.cli.commandline import add_config_arguments, config_from_args, install_stop_signals
from rft.config import ConfigError
from rft.data.tasks import DEFAULT_IMAGE_LIMITS, DatasetError, TaskSet, load_rows, rows_to_tasks
from rft.engine import build_engine
from rft.evaluation.checkpoints import Checkpoint, CheckpointError, resolve_checkpoint
from rft.evaluation.config import EvalConfig, EvalSetConfig
from rft.evaluation.metrics import SetScores, score_tasks
from rft.explorer.config import ExplorerConfig
from rft.models.config import ModelConfig
from rft.observability.metrics import MetricsLogger
from rft.rewards import RewardContext, RewardWorkers, build_reward
from rft.run.config import Config
from rft.schema import ImageLimits
from rft.weights.store import WeightStoreError
from rft.weights.stores import VersionStore, open_store, store_exists
from rft.weights.subscriber import load_newest_weights
from rft.workflows import build_workflow

if TYPE_CHECKING:
    from rft.engine import Engine
    from rft.schema import TaskRecord
    from rft.workflows import Workflow

log = logging.getLogger("rft.eval")

TASKS_PER_CALL = 256  # tasks per workflow call: the engine batches all of their samples
POLL_S = 1.0  # --follow: pause between looks at the weight store


@dataclass
class EvalSet:
    name: str
    tasks: list[TaskRecord]
    workflow: Workflow


def sampling_explorer(explorer: ExplorerConfig, evaluation: EvalConfig, eval_set: EvalSetConfig) -> ExplorerConfig:
    """The explorer section as the explorer stack sees it for one task set: eval's sampling settings and the set's
    reward (a copy; `explorer` is not changed)."""
    e = evaluation
    return dataclasses.replace(
        explorer, n_samples=e.n_samples, temperature=e.temperature, top_p=e.top_p,
        max_tokens=e.max_tokens or explorer.max_tokens, reward=eval_set.reward or explorer.reward,
        reward_weights={} if eval_set.reward else explorer.reward_weights, greedy_baseline=False)


def load_eval_sets(evaluation: EvalConfig, explorer: ExplorerConfig, model: ModelConfig, *, run_id: str,
                   seed: int, workers: RewardWorkers | None = None,
                   images: ImageLimits = DEFAULT_IMAGE_LIMITS) -> list[EvalSet]:
    """Every `eval.sets` entry's tasks and its workflow; a DatasetError names the set's key (`eval.sets[i].path`).
    `run_id` is the run's name, `seed` its `run.seed` (for a reward's own engine); `workers`: the reward worker
    processes per-response rewards run in, under their time limit (None: in this process); `images` the run's
    image limits (`ImageLimits.of(cfg.data)`)."""
    task_sets = []
    for i, eval_set in enumerate(evaluation.sets):
        source = TaskSet(key=f"eval.sets[{i}]", id_prefix="", path=eval_set.path, format=eval_set.format, weight=1.0,
                         epochs=1, prompt_key=eval_set.prompt_key, answer_key=eval_set.answer_key,
                         prompt_template=eval_set.prompt_template, generated_tasks=eval_set.generated_tasks,
                         seed=eval_set.seed, options=eval_set.options, images=images)
        tasks = rows_to_tasks(load_rows(source), source, run_id=run_id)
        sampled = sampling_explorer(explorer, evaluation, eval_set)
        reward = build_reward(sampled, RewardContext.of(sampled, model, seed=seed, workers=workers))
        task_sets.append(EvalSet(eval_set.name, tasks, build_workflow(sampled, model, reward)))
    return task_sets


class Evaluator:
    """Scores the weights an engine holds on every task set and logs one metrics record per evaluation."""

    def __init__(self, evaluation: EvalConfig, task_sets: list[EvalSet], engine: Engine, *,
                 metrics: MetricsLogger, progress: bool):
        self.evaluation, self.task_sets, self.engine, self.progress = evaluation, task_sets, engine, progress
        self.metrics = metrics

    def evaluate(self, checkpoint: Checkpoint) -> dict[str, SetScores]:
        started = time.monotonic()
        scores = {task_set.name: self._score(task_set) for task_set in self.task_sets}
        record: dict = {} if checkpoint.step is None else {"step": checkpoint.step}
        record.update({"eval/checkpoint": checkpoint.label, "eval/seconds": round(time.monotonic() - started, 3)})
        for name, set_scores in scores.items():
            record.update(set_scores.metrics(name))
        self.metrics.log(record, step=checkpoint.step)
        return scores

    def _score(self, task_set: EvalSet) -> SetScores:
        from tqdm import tqdm

        e = self.evaluation
        rewards: list[list[float]] = []
        errors: list[str] = []
        with tqdm(total=len(task_set.tasks), desc=f"eval {task_set.name}", unit="task",
                  disable=not self.progress) as bar:
            for start in range(0, len(task_set.tasks), TASKS_PER_CALL):
                chunk = task_set.tasks[start:start + TASKS_PER_CALL]
                for result in task_set.workflow.explore(chunk, self.engine):
                    if result.error is not None:
                        errors.append(result.error)
                    rewards.append([0.0] * e.n_samples if result.error else [s.reward for s in result.samples])
                bar.update(len(chunk))
        if errors:
            log.warning("eval set %s: %d tasks could not run and count as wrong; the first: %s", task_set.name,
                        len(errors), errors[0])
        return score_tasks(rewards, k=e.k, threshold=e.correct_threshold, errors=len(errors))

    def close(self) -> None:
        self.metrics.close()
        self.engine.close()


# --------------------------------------------------------------------------------------------------
# Named checkpoints


def evaluate_checkpoints(evaluator: Evaluator,
                         checkpoints: list[Checkpoint]) -> list[tuple[Checkpoint, dict[str, SetScores]]]:
    """Each checkpoint in order, with the evaluator's one engine, which holds the first checkpoint's weights (the
    others are loaded in place). Closes the evaluator."""
    results = []
    try:
        for i, checkpoint in enumerate(checkpoints):
            if i:
                evaluator.engine.load_weights(checkpoint.path, -1 if checkpoint.step is None else checkpoint.step)
            results.append((checkpoint, evaluator.evaluate(checkpoint)))
    finally:
        evaluator.close()
    return results


def format_table(results: list[tuple[Checkpoint, dict[str, SetScores]]], k: int) -> str:
    header = ("checkpoint", "step", "set", "tasks", "accuracy", f"pass@{k}", f"mean@{k}", "errors")
    rows = [(c.label, "-" if c.step is None else str(c.step), name, str(s.tasks), f"{s.accuracy:.3f}",
             f"{s.pass_at_k:.3f}", f"{s.mean_at_k:.3f}", str(s.errors))
            for c, scores in results for name, s in scores.items()]
    widths = [max(len(row[i]) for row in (header, *rows)) for i in range(len(header))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
                     for row in (header, *rows))


# --------------------------------------------------------------------------------------------------
# Following a live run


class EvalSchedule:
    """Which published versions `--follow` evaluates: 0, N, 2N, ... (N = `every_steps`); a version past the next due
    one when the follower fell behind; and, once the run is finishing, the newest version unless it was evaluated."""

    def __init__(self, every_steps: int):
        self.every_steps, self.next_due = every_steps, 0
        self.last: int | None = None

    def due(self, version: int, *, finishing: bool = False) -> bool:
        return version >= self.next_due or (finishing and (self.last is None or version > self.last))

    def done(self, version: int) -> None:
        self.last = version
        self.next_due = max(self.next_due, (version // self.every_steps + 1) * self.every_steps)


def follow(evaluator: Evaluator, store: VersionStore, *, initial: Path, stop: threading.Event,
           finish: threading.Event, checksums: bool = True) -> int:
    """Evaluate the versions the run publishes to `store` as the schedule (`eval.every_steps`) says, until `stop`,
    or until `finish` is set and the newest version has been evaluated. The evaluator's engine starts on `initial`
    (`model.path`, version 0). A version that does not match its manifest (`checksums`: SHA-256 too) is passed over
    with a warning. Closes the evaluator."""
    schedule = EvalSchedule(evaluator.evaluation.every_steps)
    refused: set[int] = set()
    engine_holds = [initial]  # where the engine's weights were loaded from (the store may collect them since)

    def load(path: Path, version: int) -> None:
        evaluator.engine.load_weights(path, version)
        engine_holds[0] = path

    try:
        while not stop.is_set():
            finishing = finish.is_set()
            latest = store.latest()
            if schedule.due(latest[0] if latest else 0, finishing=finishing):
                newest = functools.partial(_due_or_newest, store, schedule, finishing, refused, checksums=checksums)
                load_newest_weights(evaluator.engine, newest, load=load)
                version = evaluator.engine.weights_version
                if schedule.last is not None and version <= schedule.last:  # the due versions were refused
                    schedule.done(max(refused | {version}))
                    continue
                path = engine_holds[0]  # checked as it was loaded; not looked up again (it may be collected)
                scores = evaluator.evaluate(Checkpoint(f"version {version}", path, version))
                schedule.done(version)
                log.info("version %d: %s", version, "; ".join(
                    f"{name} accuracy {s.accuracy:.3f} pass@{s.k} {s.pass_at_k:.3f} mean@{s.k} {s.mean_at_k:.3f}"
                    for name, s in scores.items()))
            elif finishing:
                break
            else:
                stop.wait(POLL_S)
    finally:
        evaluator.close()
    return 0


def _due_or_newest(store: VersionStore, schedule: EvalSchedule, finishing: bool, refused: set[int], *,
                   checksums: bool = True) -> tuple[int, Path] | None:
    """The version due next while the store still has it (the follower fell behind less than `sync.keep_versions`
    versions), else the newest; either only if it matches its manifest (`VersionStore.local`, as explorers check what
    they load). A version that does not is logged once and added to `refused`."""
    due = schedule.next_due
    candidates = [due] if not finishing and store.has(due) else []
    newest = store.latest()
    if newest is not None and newest[0] not in candidates:
        candidates.append(newest[0])
    for version in candidates:
        if version in refused:
            continue
        try:
            path = store.local(version, checksums=checksums)
        except FileNotFoundError:
            continue  # garbage-collected meanwhile
        except WeightStoreError as e:
            log.warning("not evaluating weights version %d: it does not match its manifest: %s", version, e)
            refused.add(version)
            continue
        return version, path
    return None


# --------------------------------------------------------------------------------------------------
# Command line


def build_evaluator(cfg: Config, task_sets: list[EvalSet], *, model_path: str | None = None,
                    progress: bool) -> Evaluator:
    """Composes an Evaluator from the run's sections: an engine of `explorer.engine` on `model_path` (default
    `model.path`), logging to the run's metrics.jsonl."""
    engine = build_engine(cfg.explorer, cfg.model, seed=cfg.run.seed, model_path=model_path)
    metrics = MetricsLogger(cfg.run_dir, cfg.monitor, run_name=f"{cfg.run.name}-eval")
    return Evaluator(cfg.eval, task_sets, engine, metrics=metrics, progress=progress)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="rft eval", description="Evaluate checkpoints on the task sets of "
                                     "eval.sets: accuracy, pass@k and mean@k, to the run's metrics.jsonl.")
    add_config_arguments(parser)
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--checkpoint", action="append", metavar="PATH|latest|initial",
                       help="an HF model directory (e.g. runs/NAME/final), 'latest' (the run's newest weights) or "
                            "'initial' (model.path); repeatable, evaluated in order")
    which.add_argument("--follow", action="store_true",
                       help="evaluate every eval.every_steps-th version the run publishes (what `rft run` starts)")
    args = parser.parse_args(argv)
    cfg = config_from_args(args)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s evaluator %(levelname)s %(message)s")
    if not cfg.eval.sets:
        print("rft eval: eval.sets: no task set to evaluate", file=sys.stderr)
        return 2
    if args.follow and not cfg.eval.every_steps:
        print("rft eval --follow: eval.every_steps must be > 0 (evaluate every how many versions?)", file=sys.stderr)
        return 2
    store = open_store(cfg.sync, cfg.run_dir) if store_exists(cfg.sync, cfg.run_dir) else None
    try:
        checkpoints = [resolve_checkpoint(spec, cfg.model, run_dir=cfg.run_dir, store=store,
                                          checksums=cfg.sync.verify)
                       for spec in args.checkpoint or []]
        task_sets = load_eval_sets(cfg.eval, cfg.explorer, cfg.model, run_id=cfg.run.name, seed=cfg.run.seed,
                                   workers=RewardWorkers.from_config(cfg.explorer),
                                   images=ImageLimits.of(cfg.data))
    except (CheckpointError, DatasetError, ConfigError) as e:
        print(f"rft eval: {e}", file=sys.stderr)
        return 2
    if args.follow:
        evaluator = build_evaluator(cfg, task_sets, progress=False)  # model.path holds version 0
        return follow(evaluator, open_store(cfg.sync, cfg.run_dir), initial=Path(cfg.model.path),
                      stop=_stop_on_signals(), finish=_finish_on_sigusr1(), checksums=cfg.sync.verify)
    evaluator = build_evaluator(cfg, task_sets, model_path=str(checkpoints[0].path), progress=cfg.monitor.progress)
    results = evaluate_checkpoints(evaluator, checkpoints)
    print(format_table(results, cfg.eval.k))
    return 0


def _stop_on_signals() -> threading.Event:
    stop = threading.Event()
    install_stop_signals(stop)
    return stop


def _finish_on_sigusr1() -> threading.Event:
    finish = threading.Event()

    def on_signal(signum, frame):
        log.info("SIGUSR1: the run has finished; evaluating its newest version, then leaving")
        finish.set()

    signal.signal(signal.SIGUSR1, on_signal)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGUSR1})  # `rft run` starts us with it blocked: now it may come
    return finish
