"""Cores that follow the work (rft/cores.py): the board `rft run`'s launcher writes and how the threads of the parts
that wait are split among those that compute (an explorer in a real child process on that board:
tests/integration/test_cores_across_processes.py)."""
from __future__ import annotations

import dataclasses
import json

import pytest

from rft.cli.launcher import ROLES_BY_MODE
from rft.cli.planning import core_board
from rft.cores import CoreShare, NoShare, core_share
from rft.explorer.config import ExplorerConfig
from rft.run.config import Config
from rft.trainer.config import TrainerConfig


def test_the_waiting_parts_threads_are_split_among_the_processes_that_compute(tmp_path):
    cfg = Config(trainer=TrainerConfig(data_parallel=2), explorer=ExplorerConfig(replicas=3))
    board = core_board(cfg, ROLES_BY_MODE["async"], 2, tmp_path)  # 10 threads: 2 trainer ranks, 3 explorers
    rank = CoreShare.from_environment({CoreShare.ENV: board["trainer"]})
    explorers = [CoreShare.from_environment({CoreShare.ENV: board[f"explorer-{i}"]}) for i in range(3)]
    for e in explorers:
        e.set_busy(False)
    assert rank.threads() == 2 + 6 // 2  # its own 2, and half of the three explorers' 6
    explorers[0].set_busy(True)
    assert rank.threads() == 2 + 4 // 3 and explorers[0].threads() == 2 + 4 // 3  # 4 waiting, 3 processes compute
    rank.set_busy(False)  # the trainer (both ranks) waits
    assert explorers[0].threads() == 2 + (4 + 4) // 1


def test_no_board_without_a_split_or_explorers_or_when_turned_off(tmp_path, monkeypatch):
    monkeypatch.delenv(CoreShare.ENV, raising=False)
    assert isinstance(core_share(), NoShare)  # a part started outside `rft run` keeps its threads
    cfg = Config()
    assert core_board(cfg, ROLES_BY_MODE["off_policy"], None, tmp_path) == {}  # GPUs or OMP_NUM_THREADS chosen
    assert core_board(cfg, ROLES_BY_MODE["train"], 1, tmp_path) == {}  # no explorer to share with
    cfg = dataclasses.replace(cfg, trainer=TrainerConfig(borrow_cores=False))
    assert core_board(cfg, ROLES_BY_MODE["off_policy"], 1, tmp_path) == {}
    assert not (tmp_path / "cores").exists()


def test_a_malformed_description_is_refused_by_name(tmp_path):
    with pytest.raises(ValueError, match="RFT_CORES"):
        CoreShare.from_environment({CoreShare.ENV: "not json"})
    (tmp_path / "board").write_bytes(b"\x01")
    spec = {"board": str(tmp_path / "board"), "slot": 3, "slots": [[1, 1]]}
    with pytest.raises(ValueError, match="RFT_CORES.*out of range"):
        CoreShare.from_environment({CoreShare.ENV: json.dumps(spec)})
    with pytest.raises(ValueError, match="RFT_CORES.*out of range"):
        CoreShare.from_environment({CoreShare.ENV: json.dumps({**spec, "slot": 0, "slots": [[1, 2]]})})
    with pytest.raises(ValueError, match="RFT_CORES"):
        CoreShare.from_environment({CoreShare.ENV: json.dumps({**spec, "slot": 0, "board": str(tmp_path / "no")})})


def test_a_part_that_comes_back_waits_for_the_unit_computed_on_its_threads(tmp_path, monkeypatch):
    """The trainer borrows the waiting explorer's thread for a micro-batch (its byte says 1 + 1 borrowed); the explorer
    that comes back does not compute beside it with one thread too many: its first `fit_torch` returns only once the
    trainer's next `fit_torch` gave the thread back. A part that computed all along never waits, and a borrower that
    never gives back (dead) is waited for at most YIELD_S. Two shares of one real board, in two threads of this
    process."""
    import threading
    import time

    import rft.cores

    board = core_board(Config(), ROLES_BY_MODE["async"], 1, tmp_path)
    trainer, explorer = (CoreShare.from_environment({CoreShare.ENV: board[p]}) for p in ("trainer", "explorer-0"))
    keep = lambda n: None  # noqa: E731  (torch's pool stays as it is: the board is what is tested)
    explorer.set_busy(False)
    trainer.set_busy(True)
    assert trainer.fit_torch(keep) == 2 and (tmp_path / "cores").read_bytes()[0] == 2  # 1 + 1 borrowed

    explorer.set_busy(True)  # new work came: the explorer computes again
    got: list[int] = []
    fitted = threading.Event()
    threading.Thread(target=lambda: (got.append(explorer.fit_torch(keep)), fitted.set()), daemon=True).start()
    assert not fitted.wait(0.5), "the explorer computed beside the trainer's borrowed thread"
    assert trainer.fit_torch(keep) == 1  # the trainer's next micro-batch: the explorer is busy, the thread goes back
    assert fitted.wait(30) and got == [1]
    assert explorer.fit_torch(keep) == 1  # computing all along: no wait, whatever the board says

    monkeypatch.setattr(rft.cores, "YIELD_S", 0.2)
    explorer.set_busy(False)
    assert trainer.fit_torch(keep) == 2  # and it never fits again (as if it died mid-unit)
    explorer.set_busy(True)
    started = time.monotonic()
    assert explorer.fit_torch(keep) == 1 and time.monotonic() - started >= 0.2  # after YIELD_S
