"""A config loaded for a run: `rft.config`'s checks, then every name that a registry resolves, once.

`rft.config` is a leaf (types, ranges, cross-field constraints); this module sits above the registries and
checks, when a config is loaded, every name that a component would otherwise resolve mid-run: algorithm.name,
explorer.reward / reward_weights / judge_model, explorer.workflow and environment, explorer.admission,
data.selector, trainer.operators, replay_buffer.priority (with the algorithm's support for replay),
eval.sets[i].reward and toy-task names, and every stage of a multi-stage config. Errors are `ConfigError`s
naming the source file and the dotted key. Every command that loads a config for a run goes through
`load_run_config` (`rft.commandline.config_from_args`).
"""
from __future__ import annotations

import os
from typing import Any

from rft.algorithms import build_algorithm, resolve_algorithm
from rft.config import ADMISSIONS, Config, ConfigError, EvalConfig, config_from_dict, load_config
from rft.explorer.selectors import SelectionError, build_selector
from rft.operators import OperatorError, check_operator_specs
from rft.registry import RegistryError, import_object
from rft.rewards import WEIGHTED, RewardError, check_reward_config, resolve
from rft.stages import resolve_stages
from rft.trainer.replay_buffer import resolve_priority
from rft.workflows import WorkflowError, check_workflow_config
from rft.workflows.toy_tasks import TOY_TASKS

NAME_ERRORS = (RegistryError, RewardError, WorkflowError, SelectionError, OperatorError, ConfigError)


def load_run_config(path: str | os.PathLike | None = None, overrides: list[str] = ()) -> Config:
    """`rft.config.load_config`, then `check_run_config`: the config as a run uses it."""
    cfg = load_config(path, overrides)
    check_run_config(cfg, str(path) if path else "<defaults>")
    return cfg


def run_config_from_dict(raw: dict[str, Any], source: str = "<dict>") -> Config:
    """`rft.config.config_from_dict`, then `check_run_config`."""
    cfg = config_from_dict(raw, source)
    check_run_config(cfg, source)
    return cfg


def check_run_config(cfg: Config, source: str) -> None:
    """Every registry-resolved name of `cfg` and of each of its stages; ConfigError naming `source` and the key
    (`stages[i].<key>` for a stage)."""
    check_names(cfg, source)
    if cfg.stages:
        resolve_stages(cfg, source, check=lambda stage: check_names(stage, source))


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
        resolve_algorithm(cfg.algorithm.name)
        _check_replay_algorithm(cfg)
        _check_eval_sets(cfg.eval)
    except NAME_ERRORS as e:
        message = str(e)
        raise ConfigError(message if message.startswith(f"{source}: ") else f"{source}: {message}") from None


def _check_replay_algorithm(cfg: Config) -> None:
    """Replayed groups are old experiences: the algorithm must be correct on them."""
    if cfg.replay_buffer.groups_per_step and not build_algorithm(cfg.algorithm).supports_replay:
        raise ConfigError(f"replay_buffer.groups_per_step: replayed groups are old, and algorithm "
                          f"{cfg.algorithm.name!r} is not correct on old experiences as configured (set "
                          "algorithm.off_policy_correction: true, or use sft or dpo)")


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
