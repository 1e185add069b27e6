"""Multi-stage runs: one config, stages run in order (e.g. SFT from a dataset, then GRPO), each stage starting from
the previous stage's final weights.

A config with `stages:` is the shared base of its stages; each stage is `{name: NAME, <section>: {overrides}}`,
deep-merged over the base and validated as a whole config (errors name `stages[i].<key>`). A stage that names
another algorithm than the base's inherits those of the base's `algorithm` keys that its algorithm takes too (the
others configure the base's algorithm). What a stage may not set, because the stage layout decides it:
- `run.name` = `<base run name>.<stage name>` (names the stage's topics, consumer group and records);
- `run.output_dir` = `<base run dir>/stages`, so a stage's run directory is `<base run dir>/stages/<run.name>`;
- `kafka.topic_prefix` = `<base prefix>.<stage name>` when the base sets a prefix (else the stage's run name);
- `kafka.bootstrap_servers`: every stage uses the base's broker;
- `model.path` of every stage after the first = the previous stage's `final/` (the HF export at its end; after an
  `explore` stage, which trains nothing, that stage's own `model.path`).
A finished stage leaves `stage_done.json` in its run directory (written by `rft run` after the stage ended with
0; it records a digest of the stage's resolved config). Re-running the config skips finished stages and runs the
first unfinished one, whose trainer resumes from its own checkpoint, then the rest.
"""
from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rft.algorithms import option_keys
from rft.config import ConfigError
from rft.config.loader import move_renamed_keys
from rft.config.secrets import flatten
from rft.run.config import RENAMED, Config, build_config

DONE_MARKER = "stage_done.json"
_LAYOUT_KEYS = {("run", "name"), ("run", "output_dir"), ("kafka", "topic_prefix"), ("kafka", "bootstrap_servers")}


@dataclass
class RunStage:
    index: int
    name: str
    config: Config

    @property
    def run_dir(self) -> Path:
        return self.config.run_dir

    @property
    def weights_out(self) -> Path:
        """The weights the next stage starts from: this stage's final export (an `explore` stage trains
        nothing: its own starting weights)."""
        if self.config.run.mode == "explore":
            return Path(self.config.model.path)
        return self.run_dir / "final"

    def digest(self) -> str:
        """Of the resolved config, less what does not change the stage's result: the broker address (a fresh local
        broker has a new port every run) and `monitor`."""
        body = self.config.to_dict()
        body["kafka"].pop("bootstrap_servers")
        body.pop("monitor")
        return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()[:16]

    def done(self) -> dict | None:
        marker = self.run_dir / DONE_MARKER
        return json.loads(marker.read_text()) if marker.is_file() else None

    def mark_done(self) -> None:
        body = {"stage": self.name, "run_name": self.config.run.name, "weights_out": str(self.weights_out),
                "config_digest": self.digest()}
        tmp = self.run_dir / (DONE_MARKER + ".tmp")
        tmp.write_text(json.dumps(body, indent=2) + "\n")
        tmp.replace(self.run_dir / DONE_MARKER)


def resolve_stages(cfg: Config, source: str = "<config>", *,
                   check: Callable[[Config], None] | None = None) -> list[RunStage]:
    """Every stage's own config (see the module docstring), each built like a whole config and then passed to
    `check` (rft.run.loading checks registry names there); ConfigError naming `stages[i].<key>` if one is bad."""
    base = cfg.to_dict()
    del base["stages"]
    stages: list[RunStage] = []
    for i, raw in enumerate(cfg.stages):
        name = _stage_name(raw, i, source, seen={s.name for s in stages})
        overrides = move_renamed_keys({k: v for k, v in raw.items() if k != "name"}, RENAMED, source,
                                      f"stages[{i}].")
        _check_layout_keys(overrides, i, source, first=not stages)
        merged = _deep_merge(_inherited(base, overrides), overrides)
        merged["run"].update(name=f"{cfg.run.name}.{name}", output_dir=str(cfg.run_dir / "stages"))
        merged["kafka"]["topic_prefix"] = f"{cfg.kafka.topic_prefix}.{name}" if cfg.kafka.topic_prefix else ""
        if stages:
            merged["model"]["path"] = str(stages[-1].weights_out)
        stage = _validated(merged, i, source, check)
        stage = dataclasses.replace(stage, env_refs=_kept_refs(cfg, stage, i))
        stages.append(RunStage(i, name, stage))
    return stages


def _kept_refs(cfg: Config, stage: Config, i: int) -> dict[str, str]:
    """The `${ENV}` references of the root config (and of stage i's own overrides, `stages[i].<key>`) that still
    describe the stage's value: so a stage's config.yaml redacts what the root's does."""
    root, own = flatten(cfg.to_dict()), flatten(stage.to_dict())
    refs = {key: ref for key, ref in cfg.env_refs.items() if key in own and own[key] == root.get(key)}
    prefix = f"stages[{i}]."
    refs.update({key.removeprefix(prefix): ref for key, ref in cfg.env_refs.items() if key.startswith(prefix)})
    return refs



def _stage_name(raw: dict[str, Any], i: int, source: str, *, seen: set[str]) -> str:
    name = raw.get("name")
    if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_-]+", name):
        raise ConfigError(f"{source}: stages[{i}].name: required, letters, digits, '_' or '-' (it names the stage's "
                          f"directory and topics); got {name!r}")
    if name in seen:
        raise ConfigError(f"{source}: stages[{i}].name: {name!r} names an earlier stage too")
    return name


def _check_layout_keys(overrides: dict[str, Any], i: int, source: str, *, first: bool) -> None:
    if "stages" in overrides:
        raise ConfigError(f"{source}: stages[{i}].stages: stages do not nest")
    fixed = _LAYOUT_KEYS if first else _LAYOUT_KEYS | {("model", "path")}
    for section, key in sorted(fixed):
        if isinstance(overrides.get(section), dict) and key in overrides[section]:
            why = ("a later stage starts from the previous stage's final weights" if key == "path"
                   else "the stage layout sets it (see rft/run/stages.py); set it in the base config")
            raise ConfigError(f"{source}: stages[{i}].{section}.{key}: a stage cannot set it: {why}")


def _inherited(base: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """A copy of the base config a stage with `overrides` is merged over: the whole base, but a stage that names
    another algorithm keeps of the base's `algorithm` section only the keys its algorithm takes (see the module
    docstring; an unknown name keeps them all, and the stage's validation names it)."""
    base = copy.deepcopy(base)
    override = overrides.get("algorithm")
    name = override.get("name") if isinstance(override, dict) else None
    if isinstance(name, str) and name != base["algorithm"]["name"]:
        try:
            keys = option_keys(name)
        except ValueError:
            return base
        base["algorithm"] = {k: v for k, v in base["algorithm"].items() if k == "name" or k in keys}
    return base


def _deep_merge(base: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            _deep_merge(base[key], value)
        else:
            base[key] = value
    return base


def _validated(merged: dict[str, Any], i: int, source: str, check: Callable[[Config], None] | None) -> Config:
    """The stage's Config; errors name the key under `stages[i]` (the base alone is valid, so the stage's
    overrides made it wrong)."""
    try:
        stage = build_config(merged, source, f"stages[{i}]")
        if check is not None:
            check(stage)
    except ConfigError as e:
        message = str(e).removeprefix(f"{source}: ")
        if not message.startswith("stages["):
            message = f"stages[{i}].{message}"
        raise ConfigError(f"{source}: {message}") from None
    return stage
