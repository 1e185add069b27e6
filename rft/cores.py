"""Cores that follow the work: on a machine without GPUs, the parts of a run that compute take the cores of those
that wait.

`rft run` splits this machine's cores evenly over its compute processes (OMP_NUM_THREADS each, rft/cli/launcher.py
`cpu_threads_per_part`), which is right while every part computes. But the parts take turns: an explorer that has
generated what admission allows waits for the next version while the trainer runs its step on one thread, and a
trainer starved of informative groups waits while the explorer generates on one (the flagship, 2026-11-26: the
explorer generated during 107 s of the 250 s of an 8-step run; a trainer step of 32 rows is 24 s on one thread and
14 s on two, alone). So the launcher writes a *board*, one byte per part (the trainer, each explorer), 1 while it
computes and 0 while it waits, and every process of those parts gets the board's description in `RFT_CORES` (JSON,
`CoreShare.ENV`). A part marks itself busy or waiting (`CoreShare.working`, `CoreShare.set_busy`: an explorer while
its engine generates or reloads, the trainer's rank 0 while it is starved of experiences), and before each unit of
work (a trainer micro-batch, an explorer batch or engine step) a process asks how many threads it may use now
(`CoreShare.threads`): its own share plus an equal part of the waiting parts' threads, and `CoreShare.fit_torch`
applies it to torch's OpenMP pool in the calling thread (the one that computes: OpenMP's thread count is per
thread; vLLM's CPU engine computes in the explorer's thread when it runs in-process, the CPU default).
A part that starts computing while another is mid-unit shares the cores for at most that unit. A part that never
marks itself stays busy (the board starts all ones), so nothing is borrowed by mistake; a part that dies waiting
leaves its byte 0, and its cores are free indeed. Standard library only (the launcher imports it).
"""
from __future__ import annotations

import contextlib
import json
import mmap
import os
from pathlib import Path
from typing import Callable, Iterator


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
        self._applied: int | None = None
        self._fitted = (0, 0)  # (sum, count) of what fit_torch applied since mean_threads

    @classmethod
    def from_environment(cls, environ: dict[str, str] | None = None) -> "CoreShare | None":
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
        flags = bytes(self._board)
        waiting = sum(t for j, (t, _) in enumerate(self.slots) if j != self.slot and not flags[j])
        computing = sum(p for j, (_, p) in enumerate(self.slots) if j == self.slot or flags[j])
        return self.base + waiting // computing

    def fit_torch(self, set_threads: Callable[[int], None] | None = None) -> int:
        """Apply `threads()` (to torch's intra-op threads, or `set_threads`) when it changed; returns it. Call it in
        the thread that computes. torch._C.set_num_threads, because vLLM's CPU worker replaces
        `torch.set_num_threads` with a no-op in the process it runs in."""
        n = self.threads()
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
        trainer logs it per step as `cpu_threads`."""
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


def core_share() -> "CoreShare | NoShare":
    """This process's share (`CoreShare.from_environment`), or a `NoShare`."""
    return CoreShare.from_environment() or NoShare()


def write_board(path: Path, parts: dict[str, tuple[int, int]]) -> dict[str, str]:
    """Create the board at `path` for `parts` (part name -> (threads, processes): its share when every part computes),
    every part busy. Returns each part's `RFT_CORES` value."""
    names = list(parts)
    path.write_bytes(bytes([1] * len(names)))
    slots = [list(parts[n]) for n in names]
    return {name: json.dumps({"board": str(path), "slot": i, "slots": slots}) for i, name in enumerate(names)}
