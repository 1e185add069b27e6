"""`rft run`'s part supervision with real child processes: a failed essential part (the online task publisher)
ends the run with 1 while the main part still runs; a failed explorer beside a live one is tolerated."""
from __future__ import annotations

import dataclasses
import sys
import time

from rft.cli.parts import PartRunner
from rft.evaluation.config import EvalConfig, EvalSetConfig
from rft.explorer.config import ExplorerConfig
from rft.trainer.config import TrainerConfig


def python(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def test_failed_essential_part_ends_the_run(tmp_path):
    (tmp_path / "logs").mkdir()
    runner = PartRunner(tmp_path)
    try:
        runner.start("trainer", python("import time; time.sleep(60)"))
        runner.start("explorer-0", python("import time; time.sleep(60)"))
        runner.start("explorer-1", python("raise SystemExit(3)"))
        runner.start("publisher", python("import time, sys; time.sleep(1); print('no broker'); sys.exit(2)"))
        started = time.monotonic()
        assert runner.supervise("trainer", essential={"publisher"}, poll_s=0.1) == 1
        assert time.monotonic() - started < 30
        assert runner.parts["publisher"].process.returncode == 2
        assert runner.parts["trainer"].process.poll() is None  # still running: the run stops it
    finally:
        runner.stop_all(grace_s=5)
    assert all(p.process.poll() is not None for p in runner.parts.values())
    assert "no broker" in (tmp_path / "logs" / "publisher.log").read_text()


def test_cpu_runs_split_the_cores_over_the_compute_parts(tmp_path, monkeypatch, capsys):
    """Trainer ranks, explorers and the evaluator each get cores // parts OpenMP threads (at least 1), which the
    child processes really see; an operator's OMP_NUM_THREADS, or GPUs, leave the environment alone."""
    from rft.cli.launcher import ROLES_BY_MODE
    from rft.cli.planning import cpu_threads_per_part
    from rft.run.config import Config

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(8)))
    cfg = Config(trainer=TrainerConfig(tensor_parallel=2), explorer=ExplorerConfig(replicas=1),
                 eval=EvalConfig(sets=[EvalSetConfig(name="a", path="p")], every_steps=10))
    roles = ROLES_BY_MODE["async"]
    assert cpu_threads_per_part(cfg, roles, {}) == 2  # 8 cores / (2 trainer ranks + 1 explorer + 1 evaluator)
    assert "8 CPU cores for 4 compute processes: OMP_NUM_THREADS=2" in capsys.readouterr().out
    cfg = dataclasses.replace(cfg, explorer=ExplorerConfig(replicas=20))
    assert cpu_threads_per_part(cfg, roles, {}) == 1
    assert cpu_threads_per_part(cfg, roles, {"trainer": "0,1"}) is None
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert cpu_threads_per_part(cfg, roles, {}) is None

    (tmp_path / "logs").mkdir()
    runner = PartRunner(tmp_path, threads=2)
    runner.start("explorer-0", python("import os; print('threads', os.environ['OMP_NUM_THREADS'])"))
    runner.parts["explorer-0"].process.wait(timeout=30)
    assert "threads 2" in (tmp_path / "logs" / "explorer-0.log").read_text()


def test_a_float32_run_on_a_cpu_with_native_bfloat16_is_told_so(tmp_path, capsys):
    """The flags come from Linux's /proc/cpuinfo format (two processors, the flags line of each); a CPU without
    them, a bfloat16 run or GPUs print nothing."""
    from rft.cli.planning import bf16_hint
    from rft.run.config import Config

    def cpuinfo(flags: str):
        path = tmp_path / f"cpuinfo-{len(flags)}"
        path.write_text("".join(f"processor\t: {i}\nvendor_id\t: AuthenticAMD\nflags\t\t: fpu sse2 avx2 {flags}\n\n"
                                for i in range(2)))
        return path

    cfg = Config()
    assert cfg.model.dtype == "float32"
    assert bf16_hint(cfg, {}, cpuinfo("avx512f avx512_bf16"))
    assert "natively (avx512_bf16): --set model.dtype=bfloat16" in capsys.readouterr().out
    assert bf16_hint(cfg, {}, cpuinfo("amx_tile amx_bf16 avx512_bf16"))
    assert "(avx512_bf16, amx_bf16)" in capsys.readouterr().out
    assert not bf16_hint(cfg, {}, cpuinfo("avx512f"))  # avx512 without its bfloat16 extension
    assert not bf16_hint(cfg, {"trainer": "0"}, cpuinfo("avx512_bf16"))
    assert not bf16_hint(cfg, {}, tmp_path / "absent")
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, dtype="bfloat16"))
    assert not bf16_hint(cfg, {}, cpuinfo("avx512_bf16"))
    assert capsys.readouterr().out == ""
