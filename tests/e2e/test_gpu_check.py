"""`python -m rft.ops.gpu_check --cpu`: the GPU machine check on the CPU paths, in the bare environment a lent GPU
machine has. Packages that such a machine lacks (vLLM, ray, reasoning-gym, math-verify, gguf, FastAPI, TRL, ...)
are made unimportable in every process of the check (a `sitecustomize` on PYTHONPATH), so an import that would
break the command there breaks this test here. Every row must pass, except the two that cannot run without TE/Apex
or a second GPU, which must say why they were skipped."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.distributed]

REPO = Path(__file__).resolve().parents[2]
ABSENT_ON_GPU_MACHINES = ("vllm", "ray", "reasoning_gym", "math_verify", "latex2sympy2_extended", "gguf", "fastapi",
                          "uvicorn", "confluent_kafka", "trl", "datasets")
HIDE = f'''
import importlib.abc, sys
class _Absent(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {ABSENT_ON_GPU_MACHINES!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}} (hidden: absent on the GPU machines)", name=name)
        return None
sys.meta_path.insert(0, _Absent())
'''


def test_gpu_check_runs_on_the_cpu_paths_without_the_packages_gpu_machines_lack(tmp_path):
    hide = tmp_path / "hide"
    hide.mkdir()
    (hide / "sitecustomize.py").write_text(HIDE)
    env = {**os.environ, "PYTHONPATH": f"{hide}{os.pathsep}{REPO}"}
    probe = subprocess.run([sys.executable, "-c", "import vllm"], env=env, capture_output=True, text=True)
    assert probe.returncode != 0 and "hidden" in probe.stderr  # the environment really lacks them
    rows_file = tmp_path / "rows.json"
    result = subprocess.run([sys.executable, "-m", "rft.ops.gpu_check", "--cpu", "--work-dir", str(tmp_path / "work"),
                             "--json", str(rows_file)], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    rows = {r["check"]: r for r in json.loads(rows_file.read_text())}
    assert list(rows) == ["environment", "bridge-float32", "bridge-bfloat16", "train-checkpoint", "float16",
                          "distributed-optimizer", "rft-run", "mismatch", "shared-prompts", "weight-sync",
                          "push-nccl"]
    assert rows["distributed-optimizer"]["status"] == "skip" and "Apex" in rows["distributed-optimizer"]["detail"]
    assert rows["push-nccl"]["status"] == "skip"
    assert all(r["status"] == "pass" for name, r in rows.items() if name not in ("distributed-optimizer", "push-nccl"))
    assert "vllm absent" in rows["environment"]["detail"]
    for name in ("bridge-float32", "bridge-bfloat16"):
        diff, allowed, scale = map(float, re.search(r"\|logit diff\| (\S+) \(allowed (\S+) x scale (\S+)\)",
                                                    rows[name]["detail"]).groups())
        assert diff <= allowed * scale
    assert "3/3 steps" in rows["rft-run"]["detail"] and "engine transformers" in rows["rft-run"]["detail"]
    assert "reload bit-exact" in rows["train-checkpoint"]["detail"]
    found = re.search(r"mean abs dlogp (\S+) \(allowed (\S+)\)", rows["mismatch"]["detail"])
    mean, allowed = map(float, found.groups())
    assert "shared" in rows["shared-prompts"]["detail"]
    assert 0 <= mean <= allowed == 1e-3  # float32 trainer and engine on the CPU agree to rounding
    assert "| rft-run " in result.stdout  # the table operators read
