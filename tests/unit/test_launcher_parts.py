"""`rft run`'s part supervision with real child processes: a failed essential part (the online task publisher)
ends the run with 1 while the main part still runs; a failed explorer beside a live one is tolerated."""
from __future__ import annotations

import sys
import time

from rft.launcher import PartRunner


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
