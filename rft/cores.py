"""Cores that follow the work: on a machine without GPUs, the parts of a run that compute take the cores of those
that wait.

`rft run` splits this machine's cores evenly over its compute processes (OMP_NUM_THREADS each, rft/cli/planning.py
`cpu_threads_per_part`), which is right while every part computes; but the parts take turns (an explorer waits for
the next version while the trainer steps, a starved trainer waits while the explorer generates). So the launcher
writes a *board*, one byte per part (the trainer, each explorer), and every process of those parts gets its
description in `RFT_CORES` (JSON, `CoreShare.ENV`). Contract:
- a part marks itself computing or waiting (`CoreShare.set_busy`, `working`), from one of its processes;
- before each unit of work (a trainer micro-batch, an explorer batch or engine step) a process asks for its threads
  (`CoreShare.threads`: its own share plus an equal part of the waiting parts' threads), and `fit_torch` applies
  them to torch's OpenMP pool in the calling thread (OpenMP's thread count is per thread);
- a part that resumes while another computes on its threads waits, in its first `fit_torch`, until no part holds
  more threads than the board now gives it (the borrower's byte: 0 waiting, 1 + borrowed while computing), at most
  YIELD_S: overlapping them would oversubscribe the cores and slow both;
- a part that never marks itself stays busy (the board starts all ones); one that dies waiting leaves its cores free,
  one that dies borrowing costs the others at most YIELD_S each time they resume.
Applied once, where each role is composed, and only where a board exists (never with GPUs): the trainer's side is
rft/trainer/pacing.py. Standard library only (the launcher imports it).
"""
from __future__ import annotations

import contextlib
import json
import mmap
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path

YIELD_S = 5.0  # the longest a part that resumes waits for a borrower's unit to end
YIELD_POLL_S = 0.002


class CoreShare:
    """One process's view of its run's board: `slot` is its part's byte, `slots` each part's (threads, processes)."""

    ENV = "RFT_CORES"

    def __init__(self, board: str | os.PathLike, *, slot: int, slots: list[tuple[int, int]]):
        if not 0 <= slot < len(slots) or any(t < p or p < 1 for t, p in slots):
            raise ValueError(f"{self.ENV}: slot {slot} of {slots} (threads, processes): out of range")
        self.slot, self.slots = slot, slots
        self.base = slots[slot][0] // slots[slot][1]
        with open(board, "r+b") as f:
            self._board = mmap.mmap(f.fileno(), len(slots))
        self._busy: bool | None = None
        self._resumed = False  # busy again since the last fit_torch: yield to borrowers first
        self._applied: int | None = None
        self._fitted = (0, 0)  # (sum, count) of what fit_torch applied since mean_threads

    @classmethod
    def from_environment(cls, environ: dict[str, str] | None = None) -> CoreShare | None:
        """The share `RFT_CORES` describes (None when it is unset: no board, e.g. with GPUs or OMP_NUM_THREADS set by
        the operator, or a part started outside `rft run`). A malformed value is refused by name."""
        value = (os.environ if environ is None else environ).get(cls.ENV)
        if not value:
            return None
        try:
            spec = json.loads(value)
            return cls(spec["board"], slot=int(spec["slot"]), slots=[(int(t), int(p)) for t, p in spec["slots"]])
        except (ValueError, KeyError, TypeError, OSError) as e:
            raise ValueError(f"{cls.ENV}={value!r}: {e}") from None

    def set_busy(self, busy: bool) -> None:
        """This part computes (True) or waits (False). Cheap: one byte, written only when it changes. A part of
        several processes marks from one of them (the trainer's rank 0)."""
        if busy != self._busy:
            self._board[self.slot] = int(busy)
            self._resumed = busy and self._busy is False
            self._busy = busy

    @contextlib.contextmanager
    def working(self) -> Iterator[None]:
        """Busy for the block, waiting after it (also when it raises)."""
        self.set_busy(True)
        try:
            yield
        finally:
            self.set_busy(False)

    def threads(self) -> int:
        """The threads this process may use now: its own share, plus the threads of the other parts that wait,
        divided evenly among the processes of the parts that compute (this one counted as computing: it asks), rounded
        down."""
        return self.base + self._borrowable(self.slot, bytes(self._board))

    def _borrowable(self, slot: int, flags: bytes) -> int:
        """The threads each process of part `slot` may borrow now (counted as computing): the waiting parts'
        threads divided evenly among the processes that compute, rounded down."""
        waiting = sum(t for j, (t, _) in enumerate(self.slots) if j != slot and not flags[j])
        computing = sum(p for j, (_, p) in enumerate(self.slots) if j == slot or flags[j])
        return waiting // computing

    def _borrowed(self) -> bool:
        """Whether another part holds more threads than the board now gives it (its byte: 1 + what it borrowed)."""
        flags = bytes(self._board)
        return any(j != self.slot and flags[j] - 1 > self._borrowable(j, flags)
                   for j in range(len(self.slots)) if flags[j])

    def _yield_to_borrowers(self) -> None:
        """Wait until no other part computes on threads this one's return took back, at most YIELD_S (module
        docstring)."""
        deadline = time.monotonic() + YIELD_S
        while self._borrowed() and time.monotonic() < deadline:
            time.sleep(YIELD_POLL_S)

    def fit_torch(self, set_threads: Callable[[int], None] | None = None) -> int:
        """Apply `threads()` (to torch's intra-op threads, or `set_threads`) when it changed; returns it. Call it in
        the thread that computes, before each unit of work. A part that has just become busy first waits for the
        parts borrowing its threads to finish their unit (module docstring); the process that marks its part records
        how many threads it borrows. torch._C.set_num_threads, because vLLM's CPU worker replaces
        `torch.set_num_threads` with a no-op in the process it runs in."""
        if self._resumed:
            self._resumed = False
            self._yield_to_borrowers()
        n = self.threads()
        if self._busy:  # the process that marks its part (the trainer's rank 0): 1 + what it borrows
            self._board[self.slot] = min(255, 1 + n - self.base)
        self._fitted = (self._fitted[0] + n, self._fitted[1] + 1)
        if n != self._applied:
            if set_threads is None:
                import torch  # heavy: only parts that compute with torch call this, and they have it loaded
                set_threads = torch._C.set_num_threads
            set_threads(n)
            self._applied = n
        return n

    def mean_threads(self) -> float | None:
        """The mean of the thread counts `fit_torch` applied since the last call (None when it was not called): the
        trainer logs it per step as `cpu_threads` (rft/trainer/pacing.py)."""
        (total, count), self._fitted = self._fitted, (0, 0)
        return total / count if count else None


class NoShare:
    """A part without a board (with GPUs, OMP_NUM_THREADS set by the operator, or started outside `rft run`): it
    marks nothing and keeps the threads it was started with."""

    def set_busy(self, busy: bool) -> None:
        pass

    def working(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def fit_torch(self, set_threads: Callable[[int], None] | None = None) -> None:
        pass


def core_share() -> CoreShare | NoShare:
    """This process's share (`CoreShare.from_environment`), or a `NoShare`."""
    return CoreShare.from_environment() or NoShare()


def write_board(path: Path, parts: dict[str, tuple[int, int]]) -> dict[str, str]:
    """Create the board at `path` for `parts` (part name -> (threads, processes): its share when every part computes),
    every part busy. Returns each part's `RFT_CORES` value."""
    names = list(parts)
    path.write_bytes(bytes([1] * len(names)))
    slots = [list(parts[n]) for n in names]
    return {name: json.dumps({"board": str(path), "slot": i, "slots": slots}) for i, name in enumerate(names)}


NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16")  # /proc/cpuinfo flags of CPUs that multiply bfloat16 natively


def native_bf16_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> list[str]:
    """The NATIVE_BF16_FLAGS this CPU reports (Linux's `cpuinfo`; [] where it cannot be read). On such a CPU a
    bfloat16 matrix product is faster than a float32 one (docs/benchmarks.md "bfloat16 on the CPU"); without them
    vLLM's bfloat16 is far slower."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return []
    flags = set()
    for line in text.splitlines():
        if line.startswith("flags"):
            flags.update(line.partition(":")[2].split())
    return [f for f in NATIVE_BF16_FLAGS if f in flags]
