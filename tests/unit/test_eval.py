"""Evaluation pieces that need no engine: the `eval` config section (errors name the key), resolving
`--checkpoint` (initial / latest / a directory) against a real weight store and trainer checkpoint state, the
follower's schedule, task sets built by the task loader, and metrics.jsonl merging an evaluation into its step."""
from __future__ import annotations

import dataclasses
import json
import shutil
import threading
from pathlib import Path

import pytest
import torch
import yaml

from rft.config import ConfigError
from rft.data.tasks import DatasetError
from rft.evaluation.checkpoints import CheckpointError, resolve_checkpoint
from rft.evaluation.main import EvalSchedule, _due_or_newest, follow, load_eval_sets, sampling_explorer
from rft.observability.metrics import read_metrics
from rft.run.loading import load_run_config
from rft.trainer.checkpoint import CheckpointDir, TrainerState
from rft.trainer.feed import FeedState
from rft.weights.store import WeightStore
from rft.weights.stores import open_store, store_exists

COPY_SET = {"name": "copy", "format": "generated", "path": "copy_char", "generated_tasks": 20, "seed": 5}


def config(tmp_path: Path, model_dir: Path, **eval_section):
    body = {"run": {"name": "ev", "output_dir": str(tmp_path / "runs")}, "model": {"path": str(model_dir)},
            "explorer": {"reward": "char_accuracy"}, "eval": eval_section}
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(body))
    return load_run_config(path)


def sampling_config(cfg, eval_set):
    """The run's config with the explorer section one eval set is sampled with."""
    return dataclasses.replace(cfg, explorer=sampling_explorer(cfg.explorer, cfg.eval, eval_set))


def eval_sets(cfg):
    return load_eval_sets(cfg.eval, cfg.explorer, cfg.model, run_id=cfg.run.name, seed=cfg.run.seed)


def resolve(spec, cfg):
    store = open_store(cfg.sync, cfg.run_dir) if store_exists(cfg.sync, cfg.run_dir) else None
    return resolve_checkpoint(spec, cfg.model, run_dir=cfg.run_dir, store=store)


@pytest.mark.parametrize("section, expected", [
    ({"k": 9}, r"eval.k: must be in \[1, eval.n_samples=8\], got 9"),
    ({"sets": [{**COPY_SET, "nme": "x"}]}, r"eval.sets\[0\].nme: unknown key \(did you mean 'name'\?\)"),
    ({"sets": [COPY_SET, COPY_SET]}, r"eval.sets\[1\].name: 'copy' names two task sets"),
    ({"sets": [{**COPY_SET, "name": ""}]}, r"eval.sets\[0\].name: required"),
    ({"sets": [{**COPY_SET, "path": "copy_chars"}]}, r"eval.sets\[0\].path: format generated needs a toy task name"),
    ({"sets": [{**COPY_SET, "reward": "exact_mach"}]}, r"eval.sets\[0\].reward: unknown reward 'exact_mach' "
                                                        r"\(did you mean 'exact_match'\?\)"),
    ({"sets": [{**COPY_SET, "format": "csv"}]}, r"eval.sets\[0\].format: must be one of"),
    ({"sets": "copy"}, r"eval.sets: expected a list"),
    ({"every_steps": 5}, r"eval.sets: eval.every_steps is set but there is no task set"),
    ({"correct_threshold": 1.5}, r"eval.correct_threshold: must be in \[0, 1\]"),
])
def test_eval_config_errors_name_the_key(tmp_path, model_dir, section, expected):
    with pytest.raises(ConfigError, match=expected) as info:
        config(tmp_path, model_dir, **section)
    assert "run.yaml" in str(info.value)


def test_task_sets_come_from_the_task_loader(tmp_path, model_dir):
    rows = tmp_path / "qa.jsonl"
    rows.write_text("".join(json.dumps({"q": f"{i}+1", "a": str(i + 1)}) + "\n" for i in range(3)))
    cfg = config(tmp_path, model_dir, n_samples=2, k=2, temperature=0.5, sets=[
        COPY_SET, {"name": "sums", "path": str(rows), "prompt_key": "q", "answer_key": "a",
                   "prompt_template": "Q: {prompt} =", "reward": "exact_match"}])
    copy, sums = eval_sets(cfg)
    assert len(copy.tasks) == 20 and all(t.prompt == f":{t.answer}" for t in copy.tasks)
    assert [t.prompt for t in sums.tasks] == ["Q: 0+1 =", "Q: 1+1 =", "Q: 2+1 ="] and sums.tasks[2].answer == "3"
    # held out: another seed than the training data's generates other rows
    training = eval_sets(config(tmp_path, model_dir, sets=[{**COPY_SET, "seed": 0}]))[0]
    assert [t.prompt for t in copy.tasks] != [t.prompt for t in training.tasks]
    view = sampling_config(cfg, cfg.eval.sets[1])
    assert (view.explorer.n_samples, view.explorer.temperature, view.explorer.reward) == (2, 0.5, "exact_match")
    assert sampling_config(cfg, cfg.eval.sets[0]).explorer.reward == "char_accuracy"

    sets = [cfg.eval.sets[0], dataclasses.replace(cfg.eval.sets[1], prompt_key="question")]
    cfg = dataclasses.replace(cfg, eval=dataclasses.replace(cfg.eval, sets=sets))
    with pytest.raises(DatasetError, match=r"no field 'question' \(eval.sets\[1\].prompt_key\)"):
        eval_sets(cfg)
    sets = [cfg.eval.sets[0], dataclasses.replace(cfg.eval.sets[1], path=str(tmp_path / "missing.jsonl"))]
    cfg = dataclasses.replace(cfg, eval=dataclasses.replace(cfg.eval, sets=sets))
    with pytest.raises(DatasetError, match=r"eval.sets\[1\].path: dataset .* does not exist"):
        eval_sets(cfg)


def publish(store: WeightStore, version: int, model_dir: Path) -> Path:
    return store.publish(version, [{"w": torch.full((2,), float(version))}], hf_dir=model_dir)


def finish_training(cfg, step: int, model_dir: Path) -> Path:
    """What the trainer leaves at the end: a committed checkpoint of `step` and final/ (an HF directory)."""
    checkpoints = CheckpointDir(cfg.run_dir)
    path = checkpoints.step_dir(step)
    path.mkdir(parents=True)
    checkpoints.write_state(path, TrainerState(step=step, feed=FeedState(), counters={}, rng={}))
    checkpoints.commit(step)
    final = cfg.run_dir / "final"
    final.mkdir()
    (final / "config.json").write_text((model_dir / "config.json").read_text())
    return final


def test_resolve_checkpoint(tmp_path, model_dir):
    cfg = config(tmp_path, model_dir)
    initial = resolve("initial", cfg)
    assert (initial.label, initial.path, initial.step) == ("initial", model_dir, 0)
    with pytest.raises(CheckpointError, match="--checkpoint latest: run 'ev' has no weights yet"):
        resolve("latest", cfg)

    store = WeightStore.for_sync(cfg.sync, cfg.run_dir)
    publish(store, 3, model_dir)
    v4 = publish(store, 4, model_dir)
    latest = resolve("latest", cfg)
    assert (latest.path, latest.step) == (v4, 4)  # a live run: the store's LATEST

    final = finish_training(cfg, 4, model_dir)
    assert resolve("latest", cfg).path == final  # the run finished: final/, same step as LATEST
    named = resolve(str(final), cfg)
    assert (named.label, named.step) == (str(final), 4)
    assert resolve(str(store.path(3)), cfg).step == 3
    assert resolve(str(model_dir), cfg).step is None  # any other directory: step unknown

    publish(store, 5, model_dir)  # training went on past final/ (a resumed run)
    assert resolve("latest", cfg).step == 5
    with pytest.raises(CheckpointError, match=r"--checkpoint .*nowhere: .* is not a Hugging Face model directory"):
        resolve(str(tmp_path / "nowhere"), cfg)


def damage(version_dir: Path, how: str) -> None:
    """Truncate the version's weight file, or flip one byte of it (same size: only the checksum tells)."""
    [shard] = version_dir.glob("*.safetensors")
    data = bytearray(shard.read_bytes())
    if how == "truncate":
        shard.write_bytes(bytes(data[:-4]))
    else:
        data[-1] ^= 0xFF
        shard.write_bytes(bytes(data))


@pytest.mark.parametrize("how, why", [("truncate", r"bytes, the manifest says \d+"), ("flip", "sha256|checksum")])
def test_a_damaged_store_version_is_not_evaluated(tmp_path, model_dir, how, why):
    cfg = config(tmp_path, model_dir)
    store = WeightStore.for_sync(cfg.sync, cfg.run_dir)
    publish(store, 1, model_dir)
    v2 = publish(store, 2, model_dir)
    assert resolve("latest", cfg).step == 2
    damage(v2, how)
    for spec in ("latest", str(v2)):
        with pytest.raises(CheckpointError, match=rf"weight store version 2 does not match its manifest.*({why})"):
            resolve(spec, cfg)
    assert resolve(str(store.path(1)), cfg).step == 1  # the intact version is still evaluated

    # --follow: the damaged version due next is passed over (refused once), the intact one is taken
    schedule, refused = EvalSchedule(1), set()
    schedule.done(0)
    assert _due_or_newest(store, schedule, False, refused) == (1, store.path(1))
    schedule.done(1)
    assert _due_or_newest(store, schedule, False, refused) is None and refused == {2}
    v3 = publish(store, 3, model_dir)
    assert _due_or_newest(store, schedule, False, refused) == (3, v3)


def test_follow_schedule():
    schedule = EvalSchedule(10)
    evaluated = []
    for version in [0, 0, 3, 9, 10, 11, 14, 23, 24, 30, 31]:
        if schedule.due(version):
            schedule.done(version)
            evaluated.append(version)
    assert evaluated == [0, 10, 23, 30]  # 23: fell behind past 20, evaluates what there is
    assert not schedule.due(31) and schedule.due(31, finishing=True)  # the run's last version
    schedule.done(31)
    assert not schedule.due(31, finishing=True)  # already evaluated: nothing left to do


def test_metrics_merge_an_evaluation_into_its_step(tmp_path):
    path = tmp_path / "metrics.jsonl"
    lines = [{"time": 1.0, "step": 10, "reward_mean": 0.5}, {"time": 2.0, "step": 11, "reward_mean": 0.6},
             {"time": 3.0, "step": 10, "eval/checkpoint": "version 10", "eval/copy/accuracy": 0.4},
             {"time": 4.0, "eval/checkpoint": "some/dir", "eval/copy/accuracy": 0.7}]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    step10, step11, unstepped = read_metrics(path)
    assert step10 == {"time": 1.0, "step": 10, "reward_mean": 0.5, "eval/checkpoint": "version 10",
                      "eval/copy/accuracy": 0.4}
    assert step11["reward_mean"] == 0.6 and unstepped["eval/copy/accuracy"] == 0.7


def test_cli_refuses_before_starting_an_engine(tmp_path, model_dir, capsys):
    from rft.evaluation.main import main

    config(tmp_path, model_dir)  # writes run.yaml without task sets
    assert main([str(tmp_path / "run.yaml"), "--checkpoint", "initial"]) == 2
    assert "eval.sets: no task set to evaluate" in capsys.readouterr().err
    config(tmp_path, model_dir, sets=[COPY_SET])
    assert main([str(tmp_path / "run.yaml"), "--checkpoint", str(tmp_path / "nowhere")]) == 2
    assert "is not a Hugging Face model directory" in capsys.readouterr().err
    assert main([str(tmp_path / "run.yaml"), "--follow"]) == 2
    assert "eval.every_steps must be > 0" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:  # neither --checkpoint nor --follow
        main([str(tmp_path / "run.yaml")])
    assert exit_info.value.code == 2


class CollectingEngine:
    """An in-memory stand-in for rft's Engine protocol (what `follow` calls: weights_version, load_weights, close):
    each version it loads is garbage-collected from the store right after, as the trainer's GC may do while the
    evaluator scores it."""

    def __init__(self, store: WeightStore):
        self.store, self.weights_version, self.loaded = store, 0, []

    def load_weights(self, path, version: int) -> None:
        self.loaded.append(version)
        self.weights_version = version
        shutil.rmtree(self.store.path(version))

    def close(self) -> None:
        pass


class RecordingEvaluator:
    """`follow`'s view of an Evaluator (its engine, its eval config's schedule, evaluate, close): records what it
    was asked to score."""

    def __init__(self, evaluation, engine):
        self.evaluation, self.engine, self.scored = evaluation, engine, []

    def evaluate(self, checkpoint):
        self.scored.append((checkpoint.label, checkpoint.step))
        return {}

    def close(self) -> None:
        self.engine.close()


def test_follow_scores_a_version_collected_after_it_was_loaded(tmp_path, model_dir):
    """A full suite run once saw the evaluator die on FileNotFoundError: it looked the loaded version up again in the
    store after the trainer had collected it; it scores what the engine loaded, wherever that was."""
    cfg = config(tmp_path, model_dir, sets=[COPY_SET], every_steps=2)
    store = WeightStore.for_sync(cfg.sync, cfg.run_dir)
    for version in (1, 2, 3):
        publish(store, version, model_dir)
    evaluator = RecordingEvaluator(cfg.eval, CollectingEngine(store))
    stop, finish = threading.Event(), threading.Event()
    finish.set()  # the trainer is done: score the newest version, then end
    assert follow(evaluator, store, initial=model_dir, stop=stop, finish=finish) == 0
    assert evaluator.engine.loaded == [3] and not store.has(3)
    assert evaluator.scored == [("version 3", 3)]
