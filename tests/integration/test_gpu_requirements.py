"""requirements/gpu.txt, the GPU install: its pins agree with setup.py, and pip resolves it binary-only for a Linux
GPU machine (Python 3.12, manylinux x86_64) without installing anything (`--dry-run --report`), so a pin that is
yanked, missing or inconsistent with the others fails here. Needs the package registries (not a GPU). pip reads each
wheel's metadata by HTTP range requests (`--use-feature=fast-deps`; whole wheels where a server refuses them):
against this machine's registry mirror, which has no PEP 658 metadata, 47 s instead of 80-119 s for whole wheels.
Mostly a wait on the registry: a WAITING test (tests/conftest.py)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.packaging import setup_requirements

REPO = Path(__file__).resolve().parents[2]
GPU_TXT = REPO / "requirements" / "gpu.txt"
# glibc 2.17 .. 2.35: pip does not widen an explicit --platform to older manylinux tags by itself
PLATFORMS = [f"manylinux_2_{minor}_x86_64" for minor in range(35, 16, -1)] + ["manylinux2014_x86_64", "linux_x86_64"]


def pins() -> dict[str, str]:
    """name (lower case, extras dropped) -> the requirement line."""
    out = {}
    for line in GPU_TXT.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            out[line.split("[")[0].split("=")[0].strip().lower()] = line
    return out


def test_setup_py_agrees_with_gpu_txt():
    p = pins()
    core, extras = setup_requirements()
    assert set(p) == {"torch", "vllm", "megatron-core", "transformer-engine"}
    assert p["torch"] in core and p["megatron-core"] in core
    assert sorted(extras["gpu"]) == sorted([p["vllm"], p["transformer-engine"]])


@pytest.mark.timeout(600)
def test_gpu_requirements_resolve_binary_only(tmp_path):
    report = tmp_path / "report.json"
    command = [sys.executable, "-m", "pip", "install", "--dry-run", "--quiet", "--report", str(report),
               "--ignore-installed", "--only-binary=:all:", "--python-version", "3.12", "--use-feature=fast-deps",
               *[arg for platform in PLATFORMS for arg in ("--platform", platform)],
               "--target", str(tmp_path / "target"), "-r", str(GPU_TXT)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=580)
    assert done.returncode == 0, f"requirements/gpu.txt does not resolve:\n{done.stderr[-3000:]}"
    resolved = {item["metadata"]["name"].lower().replace("_", "-"): item["metadata"]["version"]
                for item in json.loads(report.read_text())["install"]}
    for name, line in pins().items():
        assert resolved.get(name) == line.split("==")[1], (name, resolved.get(name))
    assert resolved.get("transformer-engine-cu13") == resolved["transformer-engine"]  # TE's core library, a wheel
