"""A config loaded for a run: `rft.config`'s checks, then every name that a registry resolves, once.

`rft.config` is a leaf (types, ranges, cross-field constraints); this module sits above the registries and checks, when
a config is loaded, every name that a component would otherwise resolve mid-run: algorithm.name, explorer.reward /
reward_weights / judge_model, explorer.workflow and environment, explorer.admission, data.selector, trainer.operators,
trainer.staleness_policy, replay_buffer.priority (with the algorithm's support for replay), eval.sets[i].reward and
toy-task names, reasoning-gym dataset names and options (data, data.mix[i], eval.sets[i]: building each dataset once,
which imports reasoning_gym only when a set uses it), the optional extras the config asks for (rft/extras.py:
explorer.environment, toy-task paths, monitor.dashboard_port), and every stage of a multi-stage config; and the model
(`check_model`): when its config.json is on disk, that the trainer's bridge supports its architecture and that
trainer.tensor_parallel / pipeline_parallel divide its heads and layers (megatron_bridge.layout.layout_problem); with
`need_model` (`rft run`, `rft replay`, `rft validate`: before anything starts), also that model.path is a directory
holding a config.json. Errors are `ConfigError`s naming the source file and the dotted key. Every command that loads a
config for a run goes through `load_run_config` (`rft.cli.commandline.config_from_args`).
"""
from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

from megatron_bridge.layout import layout_problem, vocabulary_problem
from megatron_bridge.models import registered_architectures
from rft.algorithms import REPLAY_HINT, build_algorithm, build_options
from rft.config import ConfigError
from rft.data.easy_vqa import EasyVqaError, parse_path
from rft.data.gym_images import grid_task
from rft.data.gym_tasks import GymError, build_dataset
from rft.data.selectors import SelectionError, build_selector
from rft.data.tasks import IMAGE_FORMATS, TaskSet, task_sets
from rft.data.toy_tasks import TOY_TASKS, generate_rows
from rft.data.verifiers_tasks import VerifiersError, host_from_options
from rft.evaluation.config import EvalConfig
from rft.experience.operators import OperatorError, check_operator_specs
from rft.experience.priorities import resolve_priority
from rft.experience.staleness_policies import build_staleness_policy
from rft.explorer.config import ADMISSIONS
from rft.extras import MissingExtra, check_installed
from rft.models.vision import is_vision_model
from rft.modes import mode
from rft.registry import RegistryError, import_object
from rft.rewards import WEIGHTED, RewardError, check_reward_config, resolve
from rft.rewards.reasoning_gym import GYM_REWARDS
from rft.run.config import Config, config_from_dict, load_config
from rft.run.stages import resolve_stages
from rft.workflows import WorkflowError, check_workflow_config, greedy_baseline_problem, image_sets_problem

NAME_ERRORS = (RegistryError, RewardError, WorkflowError, SelectionError, OperatorError, ConfigError,
               MissingExtra)


def load_run_config(path: str | os.PathLike[str] | None = None, overrides: list[str] | tuple[str, ...] = (), *,
                    need_model: bool = False) -> Config:
    """`rft.run.config.load_config`, then `check_run_config`: the config as a run uses it
    (`with_algorithm_options`, `with_algorithm_needs`). `need_model`: the model must be on disk here (`check_model`)."""
    source = str(path) if path else "<defaults>"
    cfg = load_config(path, overrides)
    check_run_config(cfg, source, need_model=need_model)
    return with_algorithm_needs(with_algorithm_options(cfg, source), source)


def run_config_from_dict(raw: dict[str, Any], source: str = "<dict>") -> Config:
    """`rft.run.config.config_from_dict`, then `check_run_config`, `with_algorithm_options` and
    `with_algorithm_needs`."""
    cfg = config_from_dict(raw, source)
    check_run_config(cfg, source)
    return with_algorithm_needs(with_algorithm_options(cfg, source), source)


def with_algorithm_options(cfg: Config, source: str) -> Config:
    """`cfg` with every key of the chosen algorithm in `algorithm.options`, defaults included, so the resolved config
    a run saves (`<run dir>/config.yaml`) says every value its algorithm uses."""
    options = dataclasses.asdict(build_options(cfg.algorithm, source=source))
    return dataclasses.replace(cfg, algorithm=dataclasses.replace(cfg.algorithm, options=options))


def with_algorithm_needs(cfg: Config, source: str) -> Config:
    """`cfg` with the explorer keys its algorithm's needs turn on: `explorer.greedy_baseline` when it needs each
    task's greedy reward (`Needs.greedy_baseline`), so every process of the run reads it from the config."""
    if build_algorithm(cfg.algorithm, source=source).needs.greedy_baseline and not cfg.explorer.greedy_baseline:
        return dataclasses.replace(cfg, explorer=dataclasses.replace(cfg.explorer, greedy_baseline=True))
    return cfg


def check_run_config(cfg: Config, source: str, *, need_model: bool = False) -> None:
    """Every registry-resolved name of `cfg` and of each of its stages, and the model (`check_model`); ConfigError
    naming `source` and the key (`stages[i].<key>` for a stage)."""
    check_names(cfg, source)
    check_model(cfg, source, need_model=need_model)
    if cfg.stages:
        resolve_stages(cfg, source, check=lambda stage: check_names(stage, source))


def check_model(cfg: Config, source: str, *, need_model: bool = False) -> None:
    """The model as the run will use it. With `need_model`: model.path is a directory with a config.json. When the
    config.json is there and the run mode has a trainer: an architecture the bridge supports (its registry), and a
    TP x PP layout that fits (megatron_bridge.layout.layout_problem). ConfigError naming `source` and the key."""
    model = Path(cfg.model.path)
    hf_config = model / "config.json"
    if not hf_config.is_file():
        if need_model:
            what = "does not exist" if not model.exists() else (
                "is not a directory" if not model.is_dir() else "has no config.json (not a Hugging Face model)")
            raise ConfigError(f"{source}: model.path: {cfg.model.path} {what}")
        return
    if not mode(cfg.run.mode).trainer:
        return
    try:
        architectures = json.loads(hf_config.read_text()).get("architectures") or []
    except (OSError, ValueError, AttributeError) as e:
        raise ConfigError(f"{source}: model.path: {hf_config} is not readable JSON: {e}") from None
    supported = registered_architectures()
    if not set(architectures) & set(supported):
        raise ConfigError(f"{source}: model.path: {hf_config} names architecture(s) "
                          f"{', '.join(architectures) or '(none)'}; the trainer supports {', '.join(supported)}")
    problem = layout_problem(str(model), tp=cfg.trainer.tensor_parallel, pp=cfg.trainer.pipeline_parallel,
                             ep=cfg.trainer.expert_parallel,
                             options=("trainer.tensor_parallel:", "trainer.pipeline_parallel:",
                                      "trainer.expert_parallel:"))
    if problem:
        raise ConfigError(f"{source}: {problem}")
    _check_teacher(cfg, source, need_model=need_model)


def _check_teacher(cfg: Config, source: str, *, need_model: bool) -> None:
    """An algorithm that needs a teacher or a critic of its own weights (`Needs.teacher`, `Needs.critic.path`): that
    model has the student's vocabulary and splits at the trainer's TP x PP (it is sharded like the policy); the
    error names the config key that sets it. A model not on disk here is an error only with `need_model`."""
    needs = build_algorithm(cfg.algorithm, source=source).needs
    critic = needs.critic
    for path, key, role in ((needs.teacher, needs.teacher_key, "teacher"),
                            (critic.path if critic else None, critic.key if critic else "", "critic")):
        if not path or (not need_model and not (Path(path) / "config.json").is_file()):
            continue
        problem = vocabulary_problem(cfg.model.path, path, role=role) or layout_problem(
            path, tp=cfg.trainer.tensor_parallel, pp=cfg.trainer.pipeline_parallel,
            options=("trainer.tensor_parallel:", "trainer.pipeline_parallel:", "trainer.expert_parallel:"))
        if problem:
            raise ConfigError(f"{source}: {key}: {problem}")


def check_names(cfg: Config, source: str) -> None:
    """The names of one (stage) config resolve now, not mid-run."""
    try:
        check_reward_config(cfg.explorer)
        check_workflow_config(cfg.explorer)
        if cfg.explorer.admission not in ADMISSIONS:
            import_object(cfg.explorer.admission, key="explorer.admission", noun="admission")
        check_operator_specs(cfg.trainer.operators)
        build_selector(cfg.data)
        resolve_priority(cfg.replay_buffer.priority)
        build_staleness_policy(cfg.trainer.staleness_policy, window=cfg.trainer.staleness_window)
        _check_algorithm(cfg, source)
        _check_eval_sets(cfg.eval)
        _check_generated_sets(cfg)
        _check_image_sets(cfg)
        if cfg.monitor.dashboard_port:  # `rft run` starts `rft dashboard` on it
            check_installed("web", feature="monitor.dashboard_port (`rft dashboard`)")
    except NAME_ERRORS as e:
        message = str(e)
        raise ConfigError(message if message.startswith(f"{source}: ") else f"{source}: {message}") from None


def _check_algorithm(cfg: Config, source: str) -> None:
    """The algorithm builds from its section (a name that resolves, the keys of its options with their types and
    ranges), and replayed groups, which are old experiences, are ones it is correct on."""
    try:
        algorithm = build_algorithm(cfg.algorithm, source=source)
    except ConfigError:
        raise
    except ValueError as e:  # an unknown name, or an object without the Algorithm interface: names algorithm.name
        raise ConfigError(str(e)) from None
    if cfg.replay_buffer.groups_per_step and not algorithm.supports_replay:
        raise ConfigError(f"replay_buffer.groups_per_step: replayed groups are old, and algorithm "
                          f"{cfg.algorithm.name!r} is not correct on old experiences as configured ({REPLAY_HINT})")
    if algorithm.needs.greedy_baseline:
        _check_greedy_baseline(cfg)


def _check_greedy_baseline(cfg: Config) -> None:
    """An algorithm that subtracts each task's greedy reward has explorers that record it (none in offline mode:
    the recorded groups must carry it), and no served traffic (which has no greedy response)."""
    why = f"algorithm {cfg.algorithm.name!r} subtracts the reward of each task's greedy response"
    if cfg.run.mode == "serve":
        raise ConfigError(f"run.mode: serve trains on served traffic, which has no greedy response, and {why}")
    if cfg.run.mode != "offline" and (problem := greedy_baseline_problem(cfg.explorer)):
        raise ConfigError(f"{problem}; {why}")


def _check_eval_sets(e: EvalConfig) -> None:
    for i, s in enumerate(e.sets):
        key = f"eval.sets[{i}]"
        if s.format == "generated" and s.path not in TOY_TASKS:
            raise ConfigError(f"{key}.path: format generated needs a toy task name ({', '.join(TOY_TASKS)}); "
                              f"got {s.path!r}")
        if s.reward == WEIGHTED:
            raise ConfigError(f"{key}.reward: a weighted reward is configured in explorer.reward / "
                              "explorer.reward_weights; leave this empty")
        if s.reward:
            resolve(s.reward, key=f"{key}.reward")


def _check_image_sets(cfg: Config) -> None:
    """Task sets of images (`IMAGE_FORMATS`) only with a workflow that takes images (rft.workflows.registry), and not
    for a model on disk here that is text-only (its explorers would dead-letter every such task)."""
    keys = [f"{s.key}.format" for s in task_sets(cfg.data) if s.path and s.format in IMAGE_FORMATS]
    keys += [f"eval.sets[{i}].format" for i, e in enumerate(cfg.eval.sets) if e.format in IMAGE_FORMATS]
    if problem := image_sets_problem(cfg.explorer, keys):
        raise ConfigError(problem)
    if keys and (Path(cfg.model.path) / "config.json").is_file() and not is_vision_model(cfg.model.path):
        raise ConfigError(f"model.path: {cfg.model.path} is a text-only model (its config.json has no vision_config), "
                          f"and {keys[0]} gives tasks with images; use a vision-language model")


def _check_generated_sets(cfg: Config) -> None:
    """reasoning_gym sets name a dataset and options it takes; `options` only where they mean something; a
    reasoning-gym reward only on sets that can carry reasoning-gym tasks."""
    explorer_rewards = set(cfg.explorer.reward_weights) if cfg.explorer.reward == WEIGHTED else {cfg.explorer.reward}
    sets = [(s, explorer_rewards) for s in task_sets(cfg.data) if s.path]
    for i, e in enumerate(cfg.eval.sets):
        sets.append((TaskSet(key=f"eval.sets[{i}]", id_prefix="", path=e.path, format=e.format, weight=1.0, epochs=1,
                             prompt_key=e.prompt_key, answer_key=e.answer_key, prompt_template=e.prompt_template,
                             generated_tasks=e.generated_tasks, seed=e.seed, options=e.options),
                     {e.reward} if e.reward else explorer_rewards))
    for task_set, rewards in sets:
        if task_set.format == "generated" and task_set.path in TOY_TASKS:
            try:  # one row shows whether the toy task takes these options
                generate_rows(task_set.path, 1, seed=task_set.seed, options=task_set.options)
            except ValueError as e:
                raise ConfigError(f"{task_set.key}.options: {e}") from None
            except MissingExtra as e:  # frozenlake and textarena tasks are made by the games of the 'envs' extra
                raise ConfigError(f"{task_set.key}.path: {e}") from None
        if task_set.format == "verifiers":
            try:  # the options' shape; the taskset itself is read by verifiers when the tasks are published
                host_from_options(task_set.path, task_set.options)
            except VerifiersError as e:
                raise ConfigError(f"{task_set.key}.{e.key}: {e}") from None
            continue
        if task_set.format not in ("reasoning_gym", "reasoning_gym_image"):
            if task_set.options and task_set.format != "generated":
                raise ConfigError(f"{task_set.key}.options: dataset options are for formats reasoning_gym, "
                                  f"reasoning_gym_image and generated, "
                                  f"and this set's format is {task_set.format}")
            if task_set.format == "easy_vqa":
                try:
                    parse_path(task_set.path)
                except EasyVqaError as e:
                    raise ConfigError(f"{task_set.key}.path: {e}") from None
            gym = sorted(rewards & set(GYM_REWARDS))
            if gym and task_set.format in ("generated", "gsm8k", "easy_vqa"):
                raise ConfigError(f"{task_set.key}.format: reward {gym[0]!r} scores reasoning_gym tasks, and this "
                                  f"set's format is {task_set.format}")
            continue
        try:
            if task_set.format == "reasoning_gym_image":
                grid_task(task_set.path)
            build_dataset(task_set.path, task_set.options, seed=task_set.seed, size=task_set.generated_tasks)
        except GymError as e:
            raise ConfigError(f"{task_set.key}.{e.key}: {e}") from None
