"""Optional features are optional: with ray, gymnasium, textarena, fastapi, uvicorn, starlette and selenium blocked
(an import hook in a sitecustomize on PYTHONPATH, in real subprocesses), `import rft` and every core module of rft,
megatron_bridge and launch import, the core commands parse, `rft validate` passes on `make quickstart`'s config,
and each optional feature used without its extra fails with the error that names the extra and the config key
(rft/extras.py). Also: rft/extras.py, setup.py's extras_require and the Makefile's install agree."""
from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from rft.extras import EXTRAS, MissingExtra, check_installed, extra_of, require
from tests.blocked_imports import blocking_env
from tests.packaging import setup_requirements

REPO = Path(__file__).resolve().parents[2]
BLOCKED = sorted(module for modules in EXTRAS.values() for module in modules)
# The modules that ARE optional features: each must fail to import without its extra (so this list cannot go stale)
OPTIONAL_MODULES = {"rft.serve.server": "fastapi", "rft.serve.app": "fastapi", "rft.observability.access": "fastapi",
                    "rft.dashboard.server": "fastapi", "benchmarks.serve": "fastapi", "launch.ray.fleet": "ray",
                    "rft.workflows.endpoint_http": "fastapi"}
QUICKSTART = ["configs/smollm2-arithmetic.yaml", "--set", "run.name=smollm2-quickstart", "--set", "run.max_steps=20"]
CORE_COMMANDS = ["validate", "run", "trainer", "explorer", "topics", "status", "publish", "replay", "eval", "broker"]

@pytest.fixture(scope="module")
def blocked_env(tmp_path_factory) -> dict[str, str]:
    """The environment of a subprocess in which the extras' modules cannot be imported."""
    return blocking_env(tmp_path_factory.mktemp("block_extras"), BLOCKED)


def run_blocked(env: dict[str, str], args: list[str], timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


WALK = textwrap.dedent("""\
    import importlib, json, pkgutil, sys

    optional = json.loads(sys.argv[1])
    for module in json.loads(sys.argv[2]):
        try:
            importlib.import_module(module)
            raise SystemExit(f"the blocker let {module} import")
        except ImportError:
            pass
    failed, optional_imported, names = {}, [], []
    for root in ("rft", "megatron_bridge", "launch", "benchmarks"):
        package = importlib.import_module(root)
        for info in pkgutil.walk_packages(package.__path__, root + "."):
            if info.name.rpartition(".")[2] == "__main__":
                continue
            names.append(info.name)
            try:
                importlib.import_module(info.name)
                if info.name in optional:
                    optional_imported.append(info.name)
            except ImportError as e:
                if optional.get(info.name) != (e.name or "").partition(".")[0]:
                    failed[info.name] = repr(e)
    from rft.cli import main

    codes = {}
    for command in json.loads(sys.argv[3]):
        try:
            codes[command] = main([command, "--help"])
        except SystemExit as e:
            codes[command] = e.code
    print(json.dumps({"modules": len(names), "failed": failed, "optional_imported": optional_imported,
                      "help": codes}))
    """)


def test_core_modules_and_commands_import_without_the_extras(blocked_env):
    done = run_blocked(blocked_env, ["-c", WALK, json.dumps(OPTIONAL_MODULES), json.dumps(BLOCKED),
                                     json.dumps(CORE_COMMANDS)])
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["modules"] > 100, report  # the walk saw the packages
    assert report["failed"] == {}, ("core modules that need an optional extra at import (import it where it is used):\n"
                                    + "\n".join(f"{m}: {e}" for m, e in sorted(report["failed"].items())))
    assert report["optional_imported"] == [], "these import without their extra: take them off OPTIONAL_MODULES"
    assert report["help"] == {command: 0 for command in CORE_COMMANDS}, done.stderr[-3000:]


def test_rft_validate_passes_on_the_quickstart_config_without_the_extras(blocked_env):
    makefile = (REPO / "Makefile").read_text()
    assert f"rft run {' '.join(QUICKSTART)}" in makefile  # the config and flags `make quickstart` runs
    done = run_blocked(blocked_env, ["-m", "rft.cli", "validate", *QUICKSTART])
    assert done.returncode == 0, done.stderr[-3000:]
    assert "valid" in done.stdout


FEATURES = textwrap.dedent("""\
    import contextlib, io, json, sys

    from rft.cli import main

    out = {}
    for argv in json.loads(sys.argv[1]):
        err = io.StringIO()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            try:
                code = main(argv)
            except SystemExit as e:  # argparse
                code = e.code
        out[" ".join(argv)] = [code, err.getvalue()]
    from rft.schema import TaskRecord
    from rft.workflows.frozenlake import FrozenLakeEnvironment

    try:
        lake = {"seed": 1, "size": 4, "is_slippery": False, "p": 0.8}
        FrozenLakeEnvironment(TaskRecord(run_id="r", task_id="t", epoch=0, prompt="p", metadata={"frozenlake": lake}))
        out["frozenlake"] = "built"
    except ImportError as e:
        out["frozenlake"] = f"{type(e).__name__}: {e}"
    print(json.dumps(out))
    """)

USES = {  # argv -> (exit code, what stderr says)
    ("serve", "configs/quickstart.yaml"):
        (3, "rft: `rft serve` needs the 'web' extra (fastapi is not installed): pip install 'rft[web]'"),
    ("dashboard", "configs/quickstart.yaml"):
        (3, "rft: `rft dashboard` needs the 'web' extra (fastapi is not installed): pip install 'rft[web]'"),
    ("bench", "serve"):
        (3, "rft: `rft bench serve` needs the 'web' extra (fastapi is not installed): pip install 'rft[web]'"),
    ("validate", "configs/smollm2-frozenlake.yaml"):
        (2, "configs/smollm2-frozenlake.yaml: explorer.environment: frozenlake needs the 'envs' extra (gymnasium is "
            "not installed): pip install 'rft[envs]'"),
    ("validate", "configs/quickstart.yaml", "--set", "data.path=textarena"):
        (2, "configs/quickstart.yaml: data.path: textarena needs the 'envs' extra (textarena is not installed): "
            "pip install 'rft[envs]'"),
    ("validate", *QUICKSTART, "--set", "monitor.dashboard_port=8765"):
        (2, "configs/smollm2-arithmetic.yaml: monitor.dashboard_port (`rft dashboard`) needs the 'web' extra "
            "(fastapi is not installed): pip install 'rft[web]'"),
}


def test_a_feature_used_without_its_extra_names_the_extra_and_the_key(blocked_env):
    done = run_blocked(blocked_env, ["-c", FEATURES, json.dumps([list(argv) for argv in USES])])
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    for argv, (code, message) in USES.items():
        assert out[" ".join(argv)][0] == code, (argv, out[" ".join(argv)])
        assert message in out[" ".join(argv)][1], (argv, out[" ".join(argv)])
    assert out["frozenlake"] == ("MissingExtra: frozenlake needs the 'envs' extra (gymnasium is not installed): "
                                 "pip install 'rft[envs]'")
    fleet = run_blocked(blocked_env, ["-m", "launch.ray.fleet", "--help"])
    assert fleet.returncode == 1
    assert "launch.ray.fleet needs the 'ray' extra (ray is not installed): pip install 'rft[ray]'" in fleet.stderr


def test_the_same_configs_pass_with_the_extras_installed(tmp_path, tiny_model):
    """The control for the test above: the same script with nothing blocked validates the same configs (exit 0, no
    error) and builds the environment, so the errors there come from the missing extras, not from the configs.
    configs/quickstart.yaml's model (assets/tiny-qwen2, made by `make assets`) is the session's tiny model here."""
    tiny = ["--set", f"model.path={tiny_model}"]
    validations = [[*argv, *(tiny if argv[1] == "configs/quickstart.yaml" else [])]
                   for argv in USES if argv[0] == "validate"]
    assert len(validations) == 3
    done = run_blocked(blocking_env(tmp_path, []), ["-c", FEATURES, json.dumps(validations)])
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out == {**{" ".join(argv): [0, ""] for argv in validations}, "frozenlake": "built"}, out


def test_require_and_check_installed_name_the_feature_and_the_extra(monkeypatch):
    monkeypatch.setitem(EXTRAS, "demo", ("rft_demo_absent",))
    assert extra_of("rft_demo_absent.sub") == "demo" and extra_of("json") is None
    with pytest.raises(MissingExtra, match=re.escape("the demo feature needs the 'demo' extra (rft_demo_absent is not "
                                                     "installed): pip install 'rft[demo]'")):
        require("rft_demo_absent.sub", feature="the demo feature")
    with pytest.raises(MissingExtra, match="'demo' extra"):
        check_installed("demo", feature="demo.key")
    with pytest.raises(ModuleNotFoundError) as info:  # a module of no extra: the ImportError as it was
        require("rft_no_such_module", feature="x")
    assert not isinstance(info.value, MissingExtra)
    assert require("json", feature="x") is json
    check_installed("envs", feature="x")  # installed here (make installs every extra)


def distribution(requirement: str) -> str:
    return re.split(r"[\[=<>~! ]", requirement, maxsplit=1)[0].lower().replace("-", "_")


def test_extras_agree_with_setup_py_and_make_installs_them():
    core, extras = setup_requirements()
    for extra, modules in EXTRAS.items():
        assert extra in extras, f"setup.py has no extra {extra!r}"
        assert {distribution(r) for r in extras[extra]} <= set(modules), (extra, extras[extra])
    assert not {distribution(r) for r in core} & set(BLOCKED), "an optional extra's package is in setup.py's CORE"
    for extra, requirements in extras.items():  # every package that installs one of these modules is in EXTRAS
        assert not {distribution(r) for r in requirements} & (set(BLOCKED) - set(EXTRAS.get(extra, ()))), extra
    make_extras = re.search(r"^EXTRAS := (\S+)$", (REPO / "Makefile").read_text(), re.M)
    assert make_extras and set(make_extras.group(1).split(",")) == set(EXTRAS)
    assert '-e ".[cpu,dev,$(EXTRAS)]"' in (REPO / "Makefile").read_text()
