"""Cores that follow the work (rft/cores.py): the board `rft run`'s launcher writes, explorers in real child
processes marking themselves waiting and busy on it, and the trainer's side resizing torch's real thread pool."""
from __future__ import annotations

import json
import sys

import pytest
import torch

from rft.cli.launcher import ROLES_BY_MODE, PartRunner, core_board
from rft.config import Config
from rft.cores import CoreShare, NoShare, core_share
from tests.waiting import wait_until

EXPLORER = """
import pathlib, sys, time
from rft.cores import core_share
share, go = core_share(), pathlib.Path(sys.argv[1])
share.set_busy(False)
print('waiting', flush=True)
while not go.exists():  # the test's signal; this child has no other channel
    time.sleep(0.05)
with share.working():
    print('busy', flush=True)
    time.sleep(600)  # killed by the test
"""


def test_the_trainer_takes_the_threads_of_waiting_explorers_and_gives_them_back(tmp_path, monkeypatch):
    cfg = Config()
    cfg.explorer.replicas = 2
    roles = ROLES_BY_MODE["off_policy"]
    board = core_board(cfg, roles, 1, tmp_path)
    assert set(board) == {"trainer", "explorer-0", "explorer-1"}
    trainer = CoreShare.from_environment({CoreShare.ENV: board["trainer"]})
    assert trainer.threads() == 1, "every explorer starts busy: nothing is borrowed by mistake"

    (tmp_path / "logs").mkdir()
    monkeypatch.setenv(CoreShare.ENV, board["trainer"])  # a part outside the board must not inherit this
    runner = PartRunner(tmp_path, threads=1, cores=board)
    threads_before = torch.get_num_threads()
    go = tmp_path / "go"
    try:
        runner.start("explorer-0", [sys.executable, "-c", EXPLORER, str(go)])
        runner.start("publisher", [sys.executable, "-c", "import os; print('cores', os.environ.get('RFT_CORES'))"])
        wait_until(lambda: trainer.threads() == 2, timeout=60, what="the trainer to see explorer-0 waiting")
        assert trainer.fit_torch() == 2 and torch.get_num_threads() == 2
        go.touch()
        wait_until(lambda: trainer.threads() == 1, timeout=60, what="the trainer to see explorer-0 busy")
        assert trainer.fit_torch() == 1 and torch.get_num_threads() == 1
        assert trainer.mean_threads() == 1.5 and trainer.mean_threads() is None
        runner.parts["publisher"].process.wait(timeout=60)
        assert "cores None" in (tmp_path / "logs" / "publisher.log").read_text()
    finally:
        runner.stop_all(grace_s=5)
        torch.set_num_threads(threads_before)
    assert "busy" in (tmp_path / "logs" / "explorer-0.log").read_text()


def test_two_trainer_ranks_split_what_is_lent_and_lenders_keep_their_own(tmp_path):
    cfg = Config()
    cfg.trainer.data_parallel, cfg.explorer.replicas = 2, 3
    board = core_board(cfg, ROLES_BY_MODE["async"], 2, tmp_path)
    rank = CoreShare.from_environment({CoreShare.ENV: board["trainer"]})
    explorers = [CoreShare.from_environment({CoreShare.ENV: board[f"explorer-{i}"]}) for i in range(3)]
    for e in explorers:
        e.set_busy(False)
    assert rank.threads() == 2 + (3 * 2) // 2  # its own 2, and half of the three explorers' 6
    explorers[0].set_busy(True)
    assert rank.threads() == 2 + 4 // 2 and explorers[0].threads() == 2
    with pytest.raises(RuntimeError, match="only lenders"):
        rank.set_busy(True)


def test_no_board_without_a_split_or_explorers_or_when_turned_off(tmp_path, monkeypatch):
    monkeypatch.delenv(CoreShare.ENV, raising=False)
    assert isinstance(core_share(), NoShare)  # a part started outside `rft run` keeps its threads
    cfg = Config()
    assert core_board(cfg, ROLES_BY_MODE["off_policy"], None, tmp_path) == {}  # GPUs or OMP_NUM_THREADS chosen
    assert core_board(cfg, ROLES_BY_MODE["train"], 1, tmp_path) == {}  # nothing to borrow from
    cfg.trainer.borrow_cores = False
    assert core_board(cfg, ROLES_BY_MODE["off_policy"], 1, tmp_path) == {}
    assert not (tmp_path / "cores").exists()


def test_a_malformed_description_is_refused_by_name(tmp_path):
    with pytest.raises(ValueError, match="RFT_CORES"):
        CoreShare.from_environment({CoreShare.ENV: "not json"})
    (tmp_path / "board").write_bytes(b"\x01")
    spec = {"board": str(tmp_path / "board"), "slot": 3, "base": 1, "lenders": [1], "borrowers": 1}
    with pytest.raises(ValueError, match="RFT_CORES.*out of range"):
        CoreShare.from_environment({CoreShare.ENV: json.dumps(spec)})
    with pytest.raises(ValueError, match="RFT_CORES"):
        CoreShare.from_environment({CoreShare.ENV: json.dumps({**spec, "board": str(tmp_path / "missing")})})
