"""Cores that follow the work across processes (rft/cores.py): an explorer in a real child process marking itself
waiting and busy on the board `rft run`'s launcher writes and resizing its own torch threads, and the trainer's side
(this test) resizing torch's real thread pool (the board's arithmetic: tests/unit/test_cores.py)."""
from __future__ import annotations

import os
import sys

import torch

from rft.cli.launcher import ROLES_BY_MODE
from rft.cli.parts import PartRunner
from rft.cli.planning import core_board
from rft.cores import CoreShare
from rft.run.config import Config
from tests.waiting import wait_until

EXPLORER = """
import signal, sys
import torch
from rft.cores import core_share
share = core_share()
share.set_busy(False)
print('waiting', flush=True)
with open(sys.argv[1]) as go:  # a FIFO: blocks until the test writes its signal and closes it
    go.read()
with share.working():
    n = share.fit_torch()
    print('threads', n, 'torch', torch.get_num_threads(), flush=True)
    signal.pause()  # until the test stops it
"""


def test_the_parts_take_the_threads_of_those_that_wait_and_give_them_back(tmp_path, monkeypatch):
    board = core_board(Config(), ROLES_BY_MODE["off_policy"], 1, tmp_path)
    assert set(board) == {"trainer", "explorer-0"}
    trainer = CoreShare.from_environment({CoreShare.ENV: board["trainer"]})
    assert trainer.threads() == 1, "every part starts busy: nothing is taken by mistake"

    (tmp_path / "logs").mkdir()
    monkeypatch.setenv(CoreShare.ENV, board["trainer"])  # a part outside the board must not inherit this
    runner = PartRunner(tmp_path, threads=1, cores=board)
    threads_before = torch.get_num_threads()
    go, log = tmp_path / "go", tmp_path / "logs" / "explorer-0.log"
    os.mkfifo(go)
    try:
        runner.start("explorer-0", [sys.executable, "-c", EXPLORER, str(go)])
        runner.start("publisher", [sys.executable, "-c", "import os; print('cores', os.environ.get('RFT_CORES'))"])
        wait_until(lambda: trainer.threads() == 2, timeout=60, what="the trainer to see explorer-0 waiting")
        assert trainer.fit_torch() == 2 and torch.get_num_threads() == 2
        trainer.set_busy(False)  # starved: explorer-0 takes the trainer's thread when it computes
        go.write_text("go")  # opens the FIFO once explorer-0 reads it
        wait_until(lambda: trainer.threads() == 1, timeout=60, what="the trainer to see explorer-0 busy")
        wait_until(lambda: "threads" in log.read_text(), timeout=60, what="explorer-0 to fit its threads")
        assert "threads 2 torch 2" in log.read_text()  # its own 1, and the waiting trainer's 1
        assert trainer.fit_torch() == 1 and torch.get_num_threads() == 1
        assert trainer.mean_threads() == 1.5 and trainer.mean_threads() is None
        runner.parts["publisher"].process.wait(timeout=60)
        assert "cores None" in (tmp_path / "logs" / "publisher.log").read_text()
    finally:
        runner.stop_all(grace_s=5)
        torch.set_num_threads(threads_before)
