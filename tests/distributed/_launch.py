"""Launching torchrun workers from the distributed tests (2 local processes, gloo, repo on PYTHONPATH)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent


def torchrun(args: list[str], *, nprocs: int = 2, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run `python -m torch.distributed.run --standalone --nproc-per-node N ARGS` from the repo root."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
           "MALLOC_MMAP_THRESHOLD_": "65536"}  # freed tensors leave resident memory at once (memory bound test)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nprocs}", *args]
    return subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


def assert_succeeded(result: subprocess.CompletedProcess) -> None:
    assert result.returncode == 0, (f"exit {result.returncode}\n--- stdout\n{result.stdout[-4000:]}\n"
                                    f"--- stderr\n{result.stderr[-8000:]}")


def run_worker_on(worker: str, out: Path, models: dict[str, Path]) -> Path:
    """Run `worker` (a file beside this one) under torchrun with SPEC.json = {"out_dir": out, **models} (paths as
    strings), assert it succeeded, and return `out`, where it wrote its results."""
    (out / "spec.json").write_text(json.dumps({"out_dir": str(out), **{k: str(v) for k, v in models.items()}}))
    assert_succeeded(torchrun([str(HERE / worker), str(out / "spec.json")]))
    return out
