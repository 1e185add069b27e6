"""The commands that only read a config or the broker never import torch (rft/lazy.py): in real subprocesses with
torch blocked (an import hook in a sitecustomize on PYTHONPATH), `rft validate` passes on the flagship config with
its model on disk (so the bridge's architecture registry and TP x PP layout check run), and the modules of `rft run`'s
launcher, its task publisher and dashboard, `rft status` and `rft topics` import and build every registered algorithm.
Each of these processes would otherwise spend about 2 s of CPU importing torch. The losses still work: the first one
computed imports it (every trainer test)."""
from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.blocked_imports import blocking_env

REPO = Path(__file__).resolve().parents[2]
FLAGSHIP = REPO / "configs" / "smollm2-arithmetic.yaml"
LIGHT_MODULES = ["rft.cli.launcher", "rft.cli.replay", "rft.explorer.publisher", "rft.dashboard.server",
                 "rft.ops.status", "rft.ops.topics.cli", "rft.cli.validate"]
@pytest.fixture(scope="module")
def without_torch(tmp_path_factory) -> dict[str, str]:
    return blocking_env(tmp_path_factory.mktemp("block_torch"), ["torch"])


def run(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)


def test_the_blocker_blocks_torch(without_torch):
    done = run(without_torch, "-c", "import torch")
    assert done.returncode != 0 and "blocked by the test" in done.stderr


def test_rft_validate_checks_the_flagship_and_its_model_without_torch(without_torch):
    model = REPO / "assets" / "smollm2-135m-instruct" / "config.json"
    assert model.is_file(), f"{model} is missing: `make smollm2` builds it (`make test` does)"
    done = run(without_torch, "-m", "rft.cli", "validate", str(FLAGSHIP))
    assert done.returncode == 0, done.stderr[-3000:]
    # and the model check did run: a layout the model cannot take is refused, still without torch
    done = run(without_torch, "-m", "rft.cli", "validate", str(FLAGSHIP), "--set", "trainer.tensor_parallel=7")
    assert done.returncode == 2 and "does not divide the model's" in done.stderr, done.stderr[-3000:]
    assert "blocked by the test" not in done.stderr


def test_the_light_commands_import_and_build_every_algorithm_without_torch(without_torch):
    script = textwrap.dedent(f"""\
        import importlib, sys
        for module in {LIGHT_MODULES!r}:
            importlib.import_module(module)
        from rft.algorithms import ALGORITHMS, build_algorithm
        from rft.algorithms.config import AlgorithmConfig
        built = [type(build_algorithm(AlgorithmConfig(name=name))).__name__ for name in ALGORITHMS
                 if name not in ("on_policy_distill", "jsd_distill")]  # need a teacher's model directory
        assert "torch" not in sys.modules, "torch was imported"
        print(len(built))
        """)
    done = run(without_torch, "-c", script)
    assert done.returncode == 0, done.stderr[-3000:]
    assert int(done.stdout.split()[-1]) >= 9


def test_the_launcher_learns_a_machine_has_no_gpu_without_torch(without_torch, tmp_path):
    """`rft run`'s launcher asks torch for the GPUs only where a GPU driver's device node exists; with none (the
    node list pointed at a path that does not exist) the answer is no GPU and torch is never imported. With one (the
    list pointed at a file that exists) it does ask torch, which the blocker refuses: the shortcut is the only
    reason the first run did not import it."""
    present = tmp_path / "nvidiactl"
    present.write_text("")
    script = textwrap.dedent("""\
        import sys
        from rft.cli import planning
        planning.GPU_DEVICE_NODES = (sys.argv[1],)
        print(planning.visible_gpus())
        """)
    env = {k: v for k, v in without_torch.items() if k != "CUDA_VISIBLE_DEVICES"}
    done = run(env, "-c", script, str(tmp_path / "absent"))
    assert done.returncode == 0 and done.stdout.split() == ["[]"], done.stderr[-3000:]
    done = run(env, "-c", script, str(present))
    assert done.returncode != 0 and "blocked by the test" in done.stderr, done.stdout
