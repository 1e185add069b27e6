"""Multi-stage configs (rft/run/stages.py) and the replay-buffer section: each stage is the base config with its
overrides, validated as a whole, with errors naming `stages[i].<key>`; the stage layout (run names, directories,
topics, weights handed from stage to stage) is fixed by the base."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from rft.config import ConfigError
from rft.run.loading import run_config_from_dict
from rft.run.stages import resolve_stages


@pytest.fixture
def base(tmp_path) -> dict:
    return {"run": {"name": "pipeline", "mode": "sync", "output_dir": str(tmp_path / "runs"), "max_steps": 5},
            "model": {"path": str(tmp_path / "model")}}


def test_stages_inherit_the_base_and_chain_weights(base, tmp_path):
    cfg = run_config_from_dict({**base, "kafka": {"topic_prefix": "team"}, "stages": [
        {"name": "sft", "run": {"mode": "offline", "max_steps": 2}, "algorithm": {"name": "sft"},
         "replay": {"from_data": True}},
        {"name": "collect", "run": {"mode": "explore"}},
        {"name": "grpo", "trainer": {"lr": 3e-4}}]})
    sft, collect, grpo = resolve_stages(cfg)
    stages_dir = tmp_path / "runs" / "pipeline" / "stages"
    assert [s.config.run.name for s in (sft, collect, grpo)] == ["pipeline.sft", "pipeline.collect", "pipeline.grpo"]
    assert sft.run_dir == stages_dir / "pipeline.sft" and grpo.run_dir == stages_dir / "pipeline.grpo"
    assert grpo.config.topic("experiences") == "team.grpo.experiences"
    assert (sft.config.run.mode, sft.config.run.max_steps, sft.config.algorithm.name) == ("offline", 2, "sft")
    assert (grpo.config.run.mode, grpo.config.run.max_steps, grpo.config.trainer.lr) == ("sync", 5, 3e-4)
    assert grpo.config.algorithm.name == "grpo" and not grpo.config.replay.from_data  # overrides stay in a stage
    assert sft.config.model.path == str(tmp_path / "model")
    assert collect.config.model.path == str(sft.run_dir / "final")
    assert grpo.config.model.path == str(sft.run_dir / "final")  # an explore stage trains nothing
    assert sft.digest() != grpo.digest() and all(not s.config.stages for s in (sft, collect, grpo))


def test_the_digest_ignores_only_the_broker_address_and_monitoring(base):
    cfg = run_config_from_dict({**base, "stages": [{"name": "a"}]})
    (stage,) = resolve_stages(cfg)
    cfg = dataclasses.replace(cfg.with_broker("host:9092"), monitor=dataclasses.replace(cfg.monitor, wandb=True))
    assert resolve_stages(cfg)[0].digest() == stage.digest()
    cfg = dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer, lr=0.5))
    assert resolve_stages(cfg)[0].digest() != stage.digest()


@pytest.mark.parametrize("stages, expected", [
    ([{"run": {"max_steps": 1}}], r"stages\[0\].name: required"),
    ([{"name": "a"}, {"name": "a"}], r"stages\[1\].name: 'a' names an earlier stage too"),
    ([{"name": "a/b"}], r"stages\[0\].name: required, letters"),
    ([{"name": "a", "trainr": {}}], r"stages\[0\].trainr: unknown key \(did you mean 'trainer'\?\)"),
    ([{"name": "a", "algorithm": {"name": "grpp"}}], r"stages\[0\].algorithm.name: .*grpp"),
    ([{"name": "a", "run": {"max_steps": 0}}], r"stages\[0\].run.max_steps: must be >= 1, got 0"),
    ([{"name": "a", "explorer": {"max_turns": 0}}], r"stages\[0\].explorer.max_turns: must be >= 1"),
    ([{"name": "a", "trainer": 4}], r"stages\[0\].trainer: expected a mapping, got int"),
    ([{"name": "a"}, {"name": "b", "model": {"path": "/elsewhere"}}],
     r"stages\[1\].model.path: a stage cannot set it: a later stage starts from the previous stage's final"),
    ([{"name": "a", "run": {"name": "x"}}], r"stages\[0\].run.name: a stage cannot set it"),
    ([{"name": "a", "kafka": {"bootstrap_servers": "h:1"}}], r"stages\[0\].kafka.bootstrap_servers: a stage cannot"),
    ([{"name": "a", "stages": []}], r"stages\[0\].stages: stages do not nest"),
    ([{"name": "a", "replay": {"from_data": True}}], r"stages\[0\].replay.from_data: .* needs run.mode offline"),
    ([{"name": "a", "replay_buffer": {"groups_per_step": 2}}], r"stages\[0\].replay_buffer.groups_per_step: replayed"),
    (["sft"], r"stages\[0\]: expected a mapping, got str"),
])
def test_bad_stages_name_the_stage_and_key(base, stages, expected):
    with pytest.raises(ConfigError, match=expected):
        run_config_from_dict({**base, "stages": stages}, source="run.yaml")


@pytest.mark.parametrize("section, expected", [
    ({"groups_per_step": -1}, r"replay_buffer.groups_per_step: must be >= 0 \(0: off\), got -1"),
    ({"max_reuse": 0}, r"replay_buffer.max_reuse: must be >= 1, got 0"),
    ({"capacity": 0}, r"replay_buffer.capacity: must be >= 1, got 0"),
    ({"decay": 1.5}, r"replay_buffer.decay: must be in \(0, 1\], got 1.5"),
    ({"priority": "variance"}, r"replay_buffer.priority: unknown priority 'variance'"),
    ({"priority": "no_such_module:f"}, r"replay_buffer.priority: .*cannot import module 'no_such_module'"),
    ({"groups_per_step": 2}, r"replay_buffer.groups_per_step: replayed groups are old, and algorithm 'grpo' is not "
                             r"correct on old experiences as configured \(set algorithm.off_policy_correction: true"),
])
def test_bad_replay_buffer_sections_name_the_key(base, section, expected):
    with pytest.raises(ConfigError, match=expected):
        run_config_from_dict({**base, "replay_buffer": section}, source="run.yaml")


def test_replay_buffer_with_a_correct_algorithm_validates(base):
    cfg = run_config_from_dict({**base, "replay_buffer": {"groups_per_step": 2, "max_reuse": 3},
                            "algorithm": {"off_policy_correction": True}})
    assert cfg.replay_buffer.groups_per_step == 2 and cfg.replay_buffer.seed is None
    assert Path(cfg.run_dir).name == "pipeline"


def test_rerun_skips_done_stages_and_refuses_inconsistent_ones(base, capsys):
    """`rft run` on a staged config whose stages are all marked done starts nothing (no broker is contacted:
    the address is unreachable); a done stage whose config changed, or a later stage that ran before an
    unfinished one, stops the run with exit 2 and says what to delete."""
    from rft.cli.launcher import run_stages

    cfg = run_config_from_dict({**base, "kafka": {"bootstrap_servers": "127.0.0.1:9"},
                            "stages": [{"name": "a", "run": {"mode": "train"}}, {"name": "b"}]})
    a, b = resolve_stages(cfg)
    for stage in (a, b):
        stage.run_dir.mkdir(parents=True)
        stage.mark_done()
    assert run_stages(cfg) == 0
    assert capsys.readouterr().out.count("is done") == 2

    changed = run_config_from_dict({**base, "kafka": {"bootstrap_servers": "127.0.0.1:9"},
                                "stages": [{"name": "a", "run": {"mode": "train", "max_steps": 7}}, {"name": "b"}]})
    assert run_stages(changed) == 2
    assert f"stage 'a' finished with another config than stages[0] now describes: delete {a.run_dir}" in \
        capsys.readouterr().err

    (a.run_dir / "stage_done.json").unlink()
    assert run_stages(cfg) == 2
    assert f"stage 'a' is not done but later stages ran ({b.run_dir})" in capsys.readouterr().err
