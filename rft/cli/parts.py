"""The parts of a run as child processes (`PartRunner`): each in its own process group, logging to
`<run dir>/logs/<part>.log`, started with its own environment (OMP_NUM_THREADS, RFT_CORES, CUDA_VISIBLE_DEVICES).

Contracts:
- `supervise` waits for the main part (the trainer): its exit 0 ends the run with 0, a failure with 1; an
  `essential` part (the online publisher, `rft serve`) that fails ends the run with 1; any other part's failure is
  reported and tolerated while an explorer remains (fleets are elastic); every explorer gone ends the run.
- A failed part is reported with its log's last lines and its own exception (`failure_line`).
- `finish` asks one part to finish its work (SIGUSR1) and waits a bounded time; `stop_all` sends SIGTERM to every
  part's process group, SIGKILL after a grace period.
- Stops: SIGINT / SIGTERM set STOP_REQUESTED (`install_run_stop_signals`); a stop that lands while a part is being
  forked and recorded is raised right after the record, so no part is left that nobody stops.
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path

from rft.cores import CoreShare
from rft.processes import signal_group, signals_blocked

EVALUATOR = "evaluator"
DASHBOARD = "dashboard"  # `rft dashboard` on monitor.dashboard_port: the live run page, stopped with the run
SERVER, JOINER = "server", "joiner"  # serve mode's parts: `rft serve` (essential) and the joiner (restartable)


@dataclass
class Part:
    name: str
    process: subprocess.Popen
    log_path: Path


STOP_REQUESTED = threading.Event()
# set while PartRunner.start forks a part and records it: a stop then only sets STOP_REQUESTED, and start raises once
# the part is recorded (a KeyboardInterrupt between the fork and the record left a part nobody stopped)
STARTING_PART = threading.Event()


def install_run_stop_signals() -> None:
    """SIGINT (Ctrl-C) and SIGTERM stop the whole run. The flag is checked between stages and on every supervision
    tick, so a stop that arrives while library code swallows the KeyboardInterrupt is still honoured."""
    def on_signal(signum, frame):
        STOP_REQUESTED.set()
        if not STARTING_PART.is_set():
            raise KeyboardInterrupt

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)


class PartRunner:
    """Child processes of a run, each in its own process group, each logging to its own file."""

    def __init__(self, run_dir: Path, *, threads: int | None = None, cores: dict[str, str] | None = None):
        """`threads`: OMP_NUM_THREADS for every part (None: inherited; see cpu_threads_per_part). `cores`: part name
        -> its RFT_CORES (see core_board); other parts get none."""
        self.run_dir, self.threads, self.cores = run_dir, threads, cores or {}
        self.parts: dict[str, Part] = {}

    def start(self, name: str, command: list[str], *, blocked_signals: tuple[int, ...] = (),
              gpus: str | None = None) -> None:
        """`blocked_signals` start blocked (pending until the part installs its handler and unblocks them), so a
        signal sent early neither kills it nor gets lost. `gpus`: the part's CUDA_VISIBLE_DEVICES (see gpu_plan)."""
        log_path = self.run_dir / "logs" / f"{name}.log"
        log = open(log_path, "ab")
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        if self.threads is not None:
            env["OMP_NUM_THREADS"] = str(self.threads)
        env.pop(CoreShare.ENV, None)  # a board is this run's: never one inherited from a run that started this one
        if name in self.cores:
            env[CoreShare.ENV] = self.cores[name]
        if gpus is not None:
            env["CUDA_VISIBLE_DEVICES"] = gpus
        STARTING_PART.set()  # a stop from here to the record is raised after it (STARTING_PART)
        try:
            with signals_blocked(blocked_signals):
                process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env,
                                           start_new_session=True)
            self.parts[name] = Part(name, process, log_path)
        finally:
            STARTING_PART.clear()
        print(f"[rft] started {name} (pid {process.pid}, log {log_path})", flush=True)
        if STOP_REQUESTED.is_set():
            raise KeyboardInterrupt  # the run's `finally` stops every recorded part, this one too

    def supervise(self, main_part: str | None, *, on_tick: Callable[[], None] | None = None, poll_s: float = 0.5,
                  essential: Collection[str] = frozenset()) -> int:
        """Wait for the main part; `essential` parts end the run (with 1) when they fail, others are tolerated."""
        reported: set[str] = set()
        while True:
            if STOP_REQUESTED.is_set():
                raise KeyboardInterrupt
            if on_tick is not None:
                on_tick()
            for part in list(self.parts.values()):
                code = part.process.poll()
                if code is None or part.name in reported:
                    continue
                reported.add(part.name)
                if part.name == main_part:
                    if code == 0:
                        print(f"[rft] {part.name} finished", flush=True)
                        return 0
                    self._report_failure(part, code)
                    return 1
                if code != 0:
                    self._report_failure(part, code)
                    if part.name in essential:
                        return 1
            explorers = [p for p in self.parts.values() if p.name.startswith("explorer")]
            if explorers and all(p.process.poll() is not None for p in explorers):
                if main_part is None:
                    return 0 if all(p.process.returncode == 0 for p in explorers) else 1
                print("[rft] every explorer has stopped: stopping the run", flush=True)
                return 1
            time.sleep(poll_s)

    def _report_failure(self, part: Part, code: int) -> None:
        lines = part.log_path.read_text(errors="replace").splitlines()
        print(f"[rft] {part.name} exited with code {code}; last lines of {part.log_path}:", file=sys.stderr)
        for line in lines[-25:]:
            print(f"    {line}", file=sys.stderr)
        cause = failure_line(lines)
        if cause:
            print(f"[rft] {part.name} failed: {cause}", file=sys.stderr)
        sys.stderr.flush()

    def finish(self, name: str, *, timeout_s: float, on_tick: Callable[[], None] | None = None,
               poll_s: float = 0.5) -> None:
        """Ask a part to finish its work and exit (SIGUSR1, to its main process only) and wait at most `timeout_s`
        (after that, stop_all stops it)."""
        part = self.parts[name]
        if part.process.poll() is not None:
            return
        print(f"[rft] waiting for the {name} to finish (at most {timeout_s:.0f} s)", flush=True)
        part.process.send_signal(signal.SIGUSR1)
        deadline = time.monotonic() + timeout_s
        while part.process.poll() is None and time.monotonic() < deadline:
            if on_tick is not None:
                on_tick()
            time.sleep(poll_s)
        if on_tick is not None:
            on_tick()
        code = part.process.poll()
        if code is None:
            print(f"[rft] the {name} did not finish within {timeout_s:.0f} s: stopping it", flush=True)
        elif code != 0:
            self._report_failure(part, code)

    def stop_all(self, grace_s: float = 15.0, *, keep: tuple[str, ...] = ()) -> None:
        """SIGTERM to every part still running (but those named in `keep`), SIGKILL after `grace_s`."""
        alive = [p for p in self.parts.values() if p.process.poll() is None and p.name not in keep]
        for part in alive:
            signal_group(part.process, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for part in alive:
            try:
                part.process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                signal_group(part.process, signal.SIGKILL)
                part.process.wait()


_EXCEPTION_LINE = re.compile(  # `[rankN]: ` (torchrun's prefix), then `XxxError: message` or `pkg.mod.Name: message`
    r"(?:\[rank\d+\]:\s*)?((?:[A-Za-z_]\w*\.)*[A-Za-z_]\w*(?:Error|Exception|Exit|Interrupt)(?::\s.*)?"
    r"|(?:[a-z_]\w*\.)+[A-Z]\w*:\s.*)$")
_LAUNCHER_EXCEPTIONS = ("ChildFailedError", "torch.distributed.elastic")


def failure_line(lines: list[str]) -> str | None:
    """The part's own exception from its log, `XxxError: message` (the last such line that is not torchrun's
    ChildFailedError report about its worker); None when the log names none."""
    for line in reversed(lines):
        m = _EXCEPTION_LINE.match(line.strip())
        if m and not any(word in line for word in _LAUNCHER_EXCEPTIONS):
            return m.group(1)
    return None
