"""Cores that follow the work: on a machine without GPUs, the trainer borrows the cores of the parts that wait.

`rft run` splits this machine's cores evenly over its compute processes (OMP_NUM_THREADS each, rft/cli/launcher.py
`cpu_threads_per_part`), which is right while every part computes. But the parts take turns: an explorer that has
generated what admission allows waits for the next version, and its core idles while the trainer runs its step on
one thread (the flagship: the explorer idle ~80% of an off_policy k=1 run, a trainer step 24 s on one thread, 14 s
on two). So the launcher writes a *board*, one byte per lending part, 1 while it computes and 0 while it waits, and
every part gets the board's description in `RFT_CORES` (JSON, `CoreShare.ENV`):
- a **lender** (an explorer: vLLM's CPU worker binds its threads at start and cannot resize them) marks itself
  busy or waiting (`CoreShare.working`, `CoreShare.set_busy`);
- a **borrower** (a trainer rank: torch resizes its OpenMP pool between operations) asks, before each micro-batch,
  how many threads it may use now (`CoreShare.threads`): its own share plus an equal part of the waiting lenders'
  threads (`CoreShare.fit_torch` applies it to torch in the calling thread, the one that runs the forward and the
  backward: OpenMP's thread count is per thread).
A lender that starts computing while a borrower is mid-micro-batch shares the cores for at most that micro-batch.
A part that never marks itself stays busy (the board starts all ones), so nothing is borrowed by mistake; a lender
that dies waiting leaves its byte 0, and its cores are free indeed. Standard library only (the launcher imports it).
"""
from __future__ import annotations

import contextlib
import json
import mmap
import os
from pathlib import Path
from typing import Callable, Iterator


class CoreShare:
    """One part's view of its run's board: `slot` is its byte (lenders) or None (borrowers), `base` its own threads,
    `lenders` the threads each lending slot gives up while it waits, `borrowers` the processes that share them."""

    ENV = "RFT_CORES"

    def __init__(self, board: str | os.PathLike, *, slot: int | None, base: int, lenders: list[int], borrowers: int):
        if base < 1 or borrowers < 1 or any(n < 1 for n in lenders) or (slot is not None
                                                                        and not 0 <= slot < len(lenders)):
            raise ValueError(f"{self.ENV}: slot {slot}, base {base}, lenders {lenders}, borrowers {borrowers}: "
                             "out of range")
        self.slot, self.base, self.lenders, self.borrowers = slot, base, lenders, borrowers
        with open(board, "r+b") as f:
            self._board = mmap.mmap(f.fileno(), len(lenders))
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
            return cls(spec["board"], slot=spec["slot"], base=int(spec["base"]),
                       lenders=[int(n) for n in spec["lenders"]], borrowers=int(spec["borrowers"]))
        except (ValueError, KeyError, TypeError, OSError) as e:
            raise ValueError(f"{cls.ENV}={value!r}: {e}") from None

    # ---- lenders

    def set_busy(self, busy: bool) -> None:
        """This lender computes (True) or waits (False). Cheap: one byte, written only when it changes."""
        if self.slot is None:
            raise RuntimeError("set_busy: this part borrows cores; only lenders mark themselves")
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

    # ---- borrowers

    def threads(self) -> int:
        """The threads this part may use now: `base`, plus (borrowers) the threads of the waiting lenders divided
        evenly among the borrowing processes, rounded down."""
        if self.slot is not None:
            return self.base
        waiting = bytes(self._board)
        return self.base + sum(n for n, busy in zip(self.lenders, waiting) if not busy) // self.borrowers

    def fit_torch(self, set_threads: Callable[[int], None] | None = None) -> int:
        """Apply `threads()` (to `torch.set_num_threads`, or `set_threads`) when it changed; returns it. Call it in
        the thread that computes."""
        n = self.threads()
        self._fitted = (self._fitted[0] + n, self._fitted[1] + 1)
        if n != self._applied:
            if set_threads is None:
                import torch  # heavy: only borrowers (trainer ranks) call this, and they have torch loaded
                set_threads = torch.set_num_threads
            set_threads(n)
            self._applied = n
        return n

    def mean_threads(self) -> float | None:
        """The mean of the thread counts `fit_torch` applied since the last call (None when it was not called): the
        trainer logs it per step as `cpu_threads`."""
        (total, count), self._fitted = self._fitted, (0, 0)
        return total / count if count else None

    def close(self) -> None:
        self._board.close()


class NoShare:
    """A part without a board (with GPUs, OMP_NUM_THREADS set by the operator, or started outside `rft run`): it
    marks nothing and keeps the threads it was started with."""

    def set_busy(self, busy: bool) -> None:
        pass

    def working(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()


def core_share() -> "CoreShare | NoShare":
    """This process's share (`CoreShare.from_environment`), or a `NoShare`."""
    return CoreShare.from_environment() or NoShare()


def write_board(path: Path, lenders: dict[str, int], borrowers: dict[str, int], *, base: int) -> dict[str, str]:
    """Create the board at `path` for `lenders` (part name -> threads it gives up while waiting) and `borrowers`
    (part name -> its processes; each gets `base` threads plus its share), every lender busy. Returns each part's
    `RFT_CORES` value."""
    names = list(lenders)
    path.write_bytes(bytes([1] * len(names)))
    common = {"board": str(path), "lenders": [lenders[n] for n in names],
              "borrowers": sum(borrowers.values())}
    env = {name: json.dumps({**common, "slot": i, "base": lenders[name]}) for i, name in enumerate(names)}
    env.update({name: json.dumps({**common, "slot": None, "base": base}) for name in borrowers})
    return env
