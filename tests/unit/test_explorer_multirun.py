"""`rft explorer A.yaml B.yaml`: what one shared engine cannot serve is refused before anything starts, naming the file
and the key (rft/explorer/multirun.py `check_runs`); a shared engine's slot takes adapter versions only
(rft/engine/shared.py). The explorer itself: tests/integration/test_explorer_runs.py."""
from __future__ import annotations

import re

import pytest
import yaml

from rft.cli import main as rft
from rft.config import ConfigError
from rft.engine import EngineError
from rft.engine.shared import require_adapter
from rft.explorer.main import shared_run
from rft.explorer.multirun import check_runs, engine_sections
from rft.run.loading import load_run_config


def _merge(base: dict, changes: dict) -> dict:
    out = dict(base)
    for key, value in changes.items():
        out[key] = _merge(base.get(key, {}), value) if isinstance(value, dict) else value
    return out


@pytest.fixture
def runs(tmp_path):
    """Write run configs A and B (LoRA runs of one base, each with its own name and store) with `changes` to B."""
    def write(changes: dict | None = None, a_changes: dict | None = None) -> list[str]:
        paths = []
        for name, extra in (("A", a_changes or {}), ("B", changes or {})):
            raw = _merge({"run": {"name": f"run-{name.lower()}", "mode": "off_policy"},
                          "model": {"path": str(tmp_path / "base"), "lora": {"rank": 8}},
                          "kafka": {"bootstrap_servers": "localhost:1"},
                          "sync": {"weight_store": str(tmp_path / f"store-{name}")}}, extra)
            path = tmp_path / f"{name}.yaml"
            path.write_text(yaml.safe_dump(raw))
            paths.append(str(path))
        return paths
    return write


@pytest.mark.parametrize("changes,key,message", [
    ({"model": {"lora": {"rank": 0}}}, "model.lora.rank", "must be > 0"),
    ({"explorer": {"engine": "transformers"}}, "explorer.engine", "must be vllm"),
    ({"sync": {"method": "push"}}, "sync.method", "must be pull"),
    ({"explorer": {"continuous": True}}, "explorer.continuous", "must be false"),
    ({"run": {"mode": "offline"}}, "run.mode", "mode offline runs no explorers"),
    ({"model": {"path": "/elsewhere/other-base"}}, "model.path", "'/elsewhere/other-base', while .*A.yaml has"),
    ({"model": {"dtype": "bfloat16"}}, "model.dtype", "same base model and engine settings"),
    ({"model": {"max_response_len": 512}}, "model.max_response_len", "same base model and engine settings"),
    ({"explorer": {"cpu_kvcache_gb": 2.0}}, "explorer.cpu_kvcache_gb", "same base model and engine settings"),
    ({"explorer": {"python_sandbox": "none"}}, "explorer.python_sandbox",
     "'none', while .*A.yaml has 'bwrap': .*the python tool's code of one run could reach the others'"),
    ({"explorer": {"python_workdir_mb": 8}}, "explorer.python_workdir_mb", "8, while .*A.yaml has 64"),
    ({"run": {"name": "run-a"}}, "run.name", "'run-a' is also .*A.yaml's"),
    ({"kafka": {"topic_prefix": "run-a"}}, "kafka.topic_prefix", "'run-a' is also .*A.yaml's"),
])
def test_what_one_engine_cannot_serve_is_refused_naming_file_and_key(runs, capsys, changes, key, message):
    a, b = runs(changes)
    assert rft(["explorer", a, b]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"rft explorer: invalid config: {b}: {key}: "), err
    assert re.search(message, err), err


def test_two_runs_with_one_store_are_refused(runs, tmp_path):
    a, b = runs({"sync": {"weight_store": str(tmp_path / "store-A")}})
    with pytest.raises(ConfigError, match=f"{b}: sync.weight_store: .* is also {a}'s"):
        check_runs([shared_run(p, load_run_config(p)) for p in (a, b)])


def test_the_first_run_is_checked_too(runs, capsys):
    a, b = runs(a_changes={"sync": {"method": "push"}})
    assert rft(["explorer", a, b]) == 2
    assert f"{a}: sync.method: must be pull" in capsys.readouterr().err


def test_the_engine_takes_every_runs_rank(runs):
    a, b = runs({"model": {"lora": {"rank": 32, "alpha": 64.0}}})
    cfgs = [load_run_config(p) for p in (a, b)]
    runs = [shared_run(p, cfg) for p, cfg in zip((a, b), cfgs, strict=True)]
    check_runs(runs)
    explorer, model = engine_sections(runs)
    assert explorer is cfgs[0].explorer and model.lora.rank == 32


def test_the_shared_engine_starts_without_any_runs_starting_adapter(runs):
    """Each run's `lora.init_from` is its own slot's version 0 (rft/explorer/main.py `run_shared`): the engine's
    default adapter, which a slot without one generates with, must not be one run's."""
    a, b = runs({"model": {"lora": {"rank": 32, "init_from": "/adapters/b"}}})
    cfgs = [load_run_config(p) for p in (a, b)]
    _, model = engine_sections([shared_run(p, cfg) for p, cfg in zip((a, b), cfgs, strict=True)])
    assert model.lora.rank == 32 and model.lora.init_from == "" and cfgs[1].model.lora.init_from == "/adapters/b"


def test_a_shared_engine_takes_adapter_versions_only(tiny_model, tmp_path):
    from tests.lora_adapters import make_peft_adapter

    require_adapter("run-a", make_peft_adapter(tiny_model, tmp_path / "adapter", rank=2, alpha=4.0, seed=0), 1)
    with pytest.raises(EngineError, match="run run-a: version 2 .* is a whole model, not a LoRA adapter"):
        require_adapter("run-a", tiny_model, 2)
