"""The typed config tree: defaults, overrides, interpolation, and an error naming file and key for each kind of
invalid config. `rft validate`'s exit codes (0 and 2), in this process (as a real subprocess:
tests/integration/test_cli_errors.py)."""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from rft.cli import main
from rft.config import ConfigError, load_yaml
from rft.run.config import Config, config_from_dict, load_config
from rft.run.loading import load_run_config


def write(tmp_path: Path, body: dict, name: str = "run.yaml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(body))
    return path


def minimal(model_dir: Path, **sections) -> dict:
    body = {"model": {"path": str(model_dir)}}
    for section, values in sections.items():
        body.setdefault(section, {}).update(values)
    return body


def test_defaults_fill_every_section(tmp_path, model_dir):
    cfg = load_config(write(tmp_path, minimal(model_dir)))
    assert isinstance(cfg, Config)
    assert cfg.run.mode == "off_policy" and cfg.kafka.bootstrap_servers == "embedded"
    assert cfg.topic("experiences") == "rft-run.experiences"
    assert cfg.to_dict().keys() == {"run", "model", "kafka", "records", "explorer", "trainer", "algorithm", "data",
                                    "sync", "replay", "monitor", "replay_buffer", "eval", "serve", "stages"}


def test_overrides_take_yaml_types(tmp_path, model_dir):
    cfg = load_config(write(tmp_path, minimal(model_dir)),
                      ["trainer.lr=3e-4", "run.max_staleness=2", "algorithm.off_policy_correction=true",
                       "kafka.security.security_protocol=SASL_SSL"])
    assert cfg.trainer.lr == 3e-4 and cfg.run.max_staleness == 2
    assert cfg.algorithm.options["off_policy_correction"] is True
    assert cfg.kafka.security == {"security_protocol": "SASL_SSL"}


def test_env_interpolation(tmp_path, model_dir, monkeypatch):
    monkeypatch.setenv("RFT_TEST_BOOTSTRAP", "kafka-1:9092,kafka-2:9092")
    monkeypatch.setenv("RFT_TEST_PARTS", "12")
    body = minimal(model_dir, kafka={"bootstrap_servers": "${RFT_TEST_BOOTSTRAP}", "partitions": "${RFT_TEST_PARTS}"},
                   run={"name": "r-${RFT_TEST_UNSET:-default}"})
    cfg = load_config(write(tmp_path, body))
    assert cfg.kafka.bootstrap_servers == "kafka-1:9092,kafka-2:9092"
    assert cfg.kafka.partitions == 12
    assert cfg.run.name == "r-default"


def test_saved_resolved_config_round_trips(tmp_path, model_dir):
    cfg = load_config(write(tmp_path, minimal(model_dir, trainer={"lr": 0.01})))
    again = load_config(write(tmp_path, yaml.safe_load(cfg.to_yaml()), "resolved.yaml"))
    assert again == cfg


@pytest.mark.parametrize("body_patch, override, expected", [
    ({"trainer": {"lrr": 1.0}}, [], r"run.yaml: trainer.lrr: unknown key \(did you mean 'lr'\?\)"),
    ({"trainre": {}}, [], r"trainre: unknown key \(did you mean 'trainer'\?\)"),
    ({"trainer": {"lr": "fast"}}, [], r"trainer.lr: expected float, got str"),
    ({"run": {"max_staleness": -1}}, [], r"run.max_staleness: must be >= 0, got -1"),
    ({"run": {"mode": "offpolicy"}}, [], r"run.mode: must be one of .* \(did you mean 'off_policy'\?\)"),
    ({"model": {"path": ""}}, [], r"model.path: required"),
    ({"monitor": {"jsonl": "yes"}}, [], r"monitor.jsonl: expected bool, got str"),
    ({"kafka": {"partitions": True}}, [], r"kafka.partitions: expected int, got bool"),
    ({}, ["trainer.micro_batch_size=0"], r"trainer.micro_batch_size: must be >= 1, got 0"),
    ({}, ["trainer.checkpoint_every=0"], r"trainer.checkpoint_every: must be >= 1, got 0"),
    ({"kafka": {"bootstrap_servers": "${RFT_SURELY_UNSET_VAR}"}}, [], r"kafka.bootstrap_servers: environment variable"),
    ({"sync": {"method": "push", "push_transport": "vllm"}, "explorer": {"engine": "transformers"}}, [],
     r"sync.push_transport: vllm \(vLLM's own weight transfer\) needs explorer.engine vllm, not transformers"),
    ({"sync": {"push_transport": "nccl"}}, [], r"sync.push_transport: must be one of"),
    ({"explorer": {"continuous": True, "engine": "transformers"}}, [],
     r"explorer.continuous: needs explorer.engine vllm \(its engine-level request API\), got transformers"),
    ({"explorer": {"continuous": True}, "sync": {"method": "push"}}, [],
     r"explorer.continuous: needs sync.method pull"),
    ({"explorer": {"inflight_updates": True}}, [], r"explorer.inflight_updates: needs explorer.continuous: true"),
    ({"explorer": {"continuous": True, "inflight_updates": True}, "model": {"lora": {"rank": 8}}}, [],
     r"explorer.inflight_updates: reloads whole models in flight"),
    ({"explorer": {"continuous": True, "inflight_updates": True, "inflight_kv": "keep"},
      "run": {"routing_replay": True}}, [], r"explorer.inflight_kv: keep turns vLLM's prefix cache off"),
    ({"explorer": {"inflight_kv": "later"}}, [], r"explorer.inflight_kv: must be one of recompute, keep"),
    ({}, ["trainer.mismatch_ratio=1"], r"trainer.mismatch_ratio: must be > 1"),
    ({}, ["explorer.max_inflight=0"], r"explorer.max_inflight: must be >= 1, got 0"),
    ({}, ["explorer.cpu_kv_block_size=16"], r"explorer.cpu_kv_block_size: must be >= 32 \(a multiple of 32\), got 16"),
    ({}, ["explorer.cpu_kv_block_size=48"], r"explorer.cpu_kv_block_size: must be a multiple of 32 .*got 48"),
    ({"trainer": {"data_parallel": 2, "expert_parallel": 4}}, [],
     r"trainer.expert_parallel: must divide trainer.data_parallel \(2\)"),
    ({}, ["trainer.expert_parallel=0"], r"trainer.expert_parallel: must be >= 1, got 0"),
    ({}, ["trainer.moe_z_loss_coeff=-0.1"], r"trainer.moe_z_loss_coeff: must be >= 0 \(0: off\), got -0.1"),
    ({}, ["model.lora.rank=-1"], r"model.lora.rank: must be >= 0"),
    ({}, ["model.lora.rank=8", "model.lora.target_modules=[q_proj]"],
     r"model.lora.target_modules: must be a non-empty"),
    ({"serve": {"adapters": {"other": "/stores/other"}}}, [], r"serve.adapters: .* model.lora.rank > 0"),
    ({"sync": {"weight_store": "gs://bucket/x"}}, [], r"sync.weight_store: .*gs:// stores are not supported"),
    ({"sync": {"weight_store": "s3://A_B/x"}}, [], r"sync.weight_store: 'A_B' is not an S3 bucket name"),
    ({"sync": {"weight_store": "s3://bucket/a/../b"}}, [], r"sync.weight_store: the prefix of .* '\.\.' part"),
    ({"sync": {"delta": True}}, [], r"sync.delta: .*needs an s3:// sync.weight_store"),
    ({"sync": {"weight_store": "s3://bucket/r", "delta": True}, "model": {"lora": {"rank": 4}}}, [],
     r"sync.delta: a LoRA version is its adapter"),
    ({"sync": {"cache_dir": "/tmp/c"}}, [], r"sync.cache_dir: only an s3:// sync.weight_store uses it"),
    ({"sync": {"weight_store": "s3://bucket/r", "s3_endpoint": "localhost:9000"}}, [],
     r"sync.s3_endpoint: an http\(s\)://HOST\[:PORT\] URL"),
    ({}, ["sync.weight_store=s3://bucket/r", "sync.full_every=0"], r"sync.full_every: must be >= 1 \(1: no deltas\)"),
    ({}, ["sync.bucket_mb=6000"], r"sync.bucket_mb: must be in \[1, 5120\]"),
])
def test_invalid_configs_name_file_and_key(tmp_path, model_dir, body_patch, override, expected):
    body = minimal(model_dir)
    for section, values in body_patch.items():
        body.setdefault(section, {}).update(values)
    with pytest.raises(ConfigError, match=expected) as info:
        load_config(write(tmp_path, body), override)
    assert "run.yaml" in str(info.value)


@pytest.mark.parametrize("text, expected", [
    ("run: [1, 2\n", r"bad.yaml:2:1: not valid YAML"),
    ("- a\n- b\n", "top level must be a mapping"),
    # PyYAML keeps the last of two equal keys without a word: a section written twice would lose the first
    ("run:\n  name: a\ntrainer:\n  lr: 1.0e-5\nrun:\n  name: b\n",
     r"bad.yaml:5:1: not valid YAML: key 'run' appears twice \(first on line 1\)"),
    ("run:\n  name: a\n  seed: 1\n  seed: 2\n", r"bad.yaml:4:3: .*key 'seed' appears twice \(first on line 3\)"),
], ids=["bad_yaml", "not_a_mapping", "section_twice", "key_twice"])
def test_a_file_that_is_not_a_config_says_where(tmp_path, text, expected):
    bad = tmp_path / "bad.yaml"
    bad.write_text(text)
    with pytest.raises(ConfigError, match=expected):
        load_config(bad)


def test_a_missing_file_is_named_and_a_merged_key_may_be_overridden(tmp_path):
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_config(tmp_path / "missing.yaml")
    # a key merged in by `<<` may be overridden: that is YAML's rule, not a repetition
    assert load_yaml("base: &b {lr: 1, seed: 3}\ntrainer:\n  <<: *b\n  lr: 2\n")["trainer"] == {"lr": 2, "seed": 3}


def run_cli(capsys, *args: str) -> tuple[int | str | None, str, str]:
    """`rft ARGS` in this process: its exit code (returned or exited with), stdout and stderr."""
    try:
        code = main(list(args))
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


def test_validate_command_exit_codes(tmp_path, model_dir, capsys):
    good = write(tmp_path, minimal(model_dir), "good.yaml")
    code, out, err = run_cli(capsys, "validate", str(good))
    assert code == 0, err
    assert "valid" in out

    bad = write(tmp_path, minimal(model_dir, explorer={"n_sample": 4}), "bad.yaml")
    code, out, err = run_cli(capsys, "validate", str(bad))
    assert code == 2
    assert "bad.yaml: explorer.n_sample: unknown key (did you mean 'n_samples'?)" in err

    code, out, err = run_cli(capsys, "validate", str(good), "--set", "run.max_staleness=-3")
    assert code == 2 and "run.max_staleness" in err


def test_shipped_configs_validate():
    """Every config in configs/ validates (model paths that only exist on GPU machines are not required to)."""
    configs = sorted(Path(__file__).resolve().parents[2].joinpath("configs").glob("*.yaml"))
    assert configs, "configs/ holds no YAML"
    for path in configs:
        load_run_config(path)


def test_unknown_algorithm_is_a_config_error(tmp_path, model_dir):
    with pytest.raises(ConfigError, match=r"run.yaml: algorithm.name: .*grpp"):
        load_run_config(write(tmp_path, minimal(model_dir, algorithm={"name": "grpp"})))


@pytest.mark.parametrize("algorithm, message", [
    ({"clip_eps_low": 1.5}, r"run.yaml: algorithm.clip_eps_low: must be in \(0, 1\]"),
    ({"clip_eps_high": 0}, r"run.yaml: algorithm.clip_eps_high: must be > 0"),
    ({"clip_eps_hi": 0.28}, r"run.yaml: algorithm.clip_eps_hi: unknown key \(did you mean 'clip_eps_high'"),
    ({"name": "builtins:repr"}, r"run.yaml: algorithm.name: 'builtins:repr' built a str without advantages"),
])
def test_algorithm_options_are_checked_when_the_config_loads(tmp_path, model_dir, algorithm, message):
    with pytest.raises(ConfigError, match=message):
        load_run_config(write(tmp_path, minimal(model_dir, algorithm=algorithm)))


def test_a_moved_key_still_loads_with_one_deprecation_line(tmp_path, caplog):
    """Keys both roles read moved to `run:`; the old names load (file, `--set`, a stage's overrides) with one warning
    naming the new key, and naming both is an error."""
    path = tmp_path / "old.yaml"
    path.write_text("model: {path: m}\ntrainer: {groups_per_step: 3}\nexplorer: {reward_min: -2.0}\n")
    with caplog.at_level("WARNING", logger="rft.config.loader"):
        cfg = load_config(path, ["trainer.routing_replay=true"])
    assert (cfg.run.groups_per_step, cfg.run.reward_min, cfg.run.routing_replay) == (3, -2.0, True)
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 3 and all("is deprecated, use run." in m for m in warned), warned
    path.write_text("model: {path: m}\ntrainer: {groups_per_step: 3}\nrun: {groups_per_step: 4}\n")
    with pytest.raises(ConfigError, match=r"trainer.groups_per_step: is the deprecated name of run.groups_per_step"):
        load_config(path)
    stage = config_from_dict({"model": {"path": "m"}, "stages": [{"name": "a", "trainer": {"groups_per_step": 5}}]})
    assert stage.stages[0]["trainer"] == {"groups_per_step": 5}  # as written; resolved when the stage is built


def test_the_checked_config_cannot_change():
    """Sections are frozen: a part derives a changed copy (`dataclasses.replace`, `Config.with_broker`)."""
    import dataclasses

    cfg = config_from_dict({"model": {"path": "m"}})
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.kafka.bootstrap_servers = "h:1"  # type: ignore[misc]
    assert cfg.with_broker("h:1").kafka.bootstrap_servers == "h:1" and cfg.kafka.bootstrap_servers == "embedded"
