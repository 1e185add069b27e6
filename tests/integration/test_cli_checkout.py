"""Developer tooling stays out of the installed package. `pip install` takes the packages setup.py finds (rft and
megatron_bridge; not benchmarks/ or tests/, nor a bench package inside rft). Installed that way (those packages
copied into a directory on PYTHONPATH, no checkout in sight), `rft gpu-check` is there and `rft bench` / `rft chaos`
say in one line that they run from a source checkout (exit 3). From a checkout they run from any directory, and
the processes they start import benchmarks/ too (rft.cli puts the checkout on their PYTHONPATH). Real subprocesses
of `python -m rft.cli` throughout."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from tests.packaging import installed_packages

REPO = Path(__file__).resolve().parents[2]


def python(args: list[str], cwd: Path, pythonpath: str | None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if pythonpath is not None:
        env["PYTHONPATH"] = pythonpath
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


def test_the_installed_packages_hold_no_developer_tooling():
    packages = installed_packages()
    assert {"rft", "rft.cli", "rft.ops", "megatron_bridge"} <= set(packages), packages
    tooling = [p for p in packages if p.split(".")[0] in ("benchmarks", "tests") or p.startswith("rft.bench")]
    assert tooling == [], f"installed with the package: {tooling}"
    assert (REPO / "benchmarks" / "__init__.py").is_file()  # what `rft bench` runs, in the checkout


def test_an_installed_rft_has_gpu_check_and_says_bench_and_chaos_need_a_checkout(tmp_path):
    site = tmp_path / "site"
    for top in sorted({p.split(".")[0] for p in installed_packages()}):
        shutil.copytree(REPO / top, site / top, ignore=shutil.ignore_patterns("__pycache__"))
    work = tmp_path / "elsewhere"
    work.mkdir()
    for command in ("bench", "chaos"):
        done = python(["-m", "rft.cli", command, "--help"], work, str(site))
        lines = [line for line in done.stderr.splitlines() if line.strip()]
        assert done.returncode == 3 and len(lines) == 1, (done.returncode, done.stdout[-2000:], done.stderr[-2000:])
        assert lines[0].startswith(f"rft: `rft {command}` runs from a source checkout"), lines[0]
    done = python(["-m", "rft.cli", "gpu-check", "--help"], work, str(site))
    assert done.returncode == 0 and "--cpu" in done.stdout, done.stderr[-2000:]


def test_from_a_checkout_bench_runs_anywhere_and_its_processes_import_benchmarks(tmp_path):
    # rft imported from the checkout with nothing on PYTHONPATH (as an editable install does), run from elsewhere
    code = (f"import os, sys; sys.path.insert(0, {str(REPO)!r}); from rft.cli import main; "
            "code = main(['bench', '--help']); print('PYTHONPATH=' + os.environ.get('PYTHONPATH', '')); sys.exit(code)")
    done = python(["-c", code], tmp_path, None)
    assert done.returncode == 0 and "usage: rft bench" in done.stdout, done.stderr[-2000:]
    children_path = done.stdout.rsplit("PYTHONPATH=", 1)[1].strip()
    child = python(["-c", "import benchmarks.main"], tmp_path, children_path)
    assert child.returncode == 0, child.stderr[-2000:]
    without = python(["-c", "import benchmarks.main"], tmp_path, None)  # the control: not importable from here alone
    assert without.returncode != 0 and "benchmarks" in without.stderr
