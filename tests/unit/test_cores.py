"""Cores that follow the work (rft/cores.py): the board `rft run`'s launcher writes and how the threads of the parts
that wait are split among those that compute (an explorer in a real child process on that board:
tests/integration/test_cores_across_processes.py)."""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from rft.cli.launcher import ROLES_BY_MODE
from rft.cli.planning import core_board
from rft.cores import CoreShare, NoShare, core_share
from rft.explorer.config import ExplorerConfig
from rft.run.config import Config
from rft.trainer.config import TrainerConfig
from tests.waiting import wait_until


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


def test_the_trainer_waits_on_the_board_while_starved_and_logs_the_threads_it_used(tmp_path):
    """The trainer as composed on a board (rft/trainer/pacing.py): its feed marks it waiting while it is starved and
    busy once its batch is in; its policy fits torch's threads before each micro-batch, and each step logs their
    mean as `cpu_threads`. The real loop over the in-memory transport with the loop tests' stand-in policy, which
    calls the `pace` hook before each micro-batch as megatron_bridge's does."""
    import threading

    from rft.trainer.main import Trainer, open_trainer_io
    from rft.transport.memory import MemoryTransport
    from tests.records import make_group
    from tests.unit.test_trainer_loop import StandInPolicy, fill, make_config

    class PacedStandIn(StandInPolicy):
        pace = None

        def train_step(self, micro_batches, loss_fn):
            for _ in micro_batches:
                self.pace()
            return super().train_step(micro_batches, loss_fn)

    cfg = make_config(tmp_path, poll_timeout_s=60.0).with_values({"run.max_steps": 2})
    (tmp_path / "logs").mkdir()
    board = core_board(Config(), ROLES_BY_MODE["off_policy"], 1, tmp_path / "logs")
    share = CoreShare.from_environment({CoreShare.ENV: board["trainer"]})
    explorer = CoreShare.from_environment({CoreShare.ENV: board["explorer-0"]})
    transport = MemoryTransport(partitions=1)
    groups = [make_group("run", i, n_samples=2, policy_version=0) for i in range(4)]
    fill(transport, cfg, groups[:2])  # step 1's; step 2 starves until the explorer comes back
    explorer.set_busy(False)  # step 1: the trainer takes the waiting explorer's thread
    trainer = Trainer(cfg.trainer, run=cfg.run, model=cfg.model, algorithm=cfg.algorithm, sync=cfg.sync,
                      run_dir=cfg.run_dir, temperature=1.0, progress=False, policy=PacedStandIn([]), cores=share,
                      open_io=lambda feed_state, replay_state: open_trainer_io(
                          cfg, feed_state=feed_state, replay_state=replay_state, transport=transport, cores=share))
    starved = threading.Event()

    def explorer_comes_back() -> None:
        wait_until(lambda: (tmp_path / "logs" / "cores").read_bytes()[0] == 0, timeout=60,
                   what="the starved trainer to mark itself waiting")
        starved.set()
        explorer.set_busy(True)
        fill(transport, cfg, groups[2:])

    threads_before = torch.get_num_threads()
    helper = threading.Thread(target=explorer_comes_back, daemon=True)
    helper.start()
    try:
        trainer.run()
    finally:
        trainer.close()
        torch.set_num_threads(threads_before)
    helper.join(timeout=60)
    assert starved.is_set()
    assert (tmp_path / "logs" / "cores").read_bytes()[0] == 1  # busy again, borrowing nothing
    metrics = [json.loads(line) for line in (cfg.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["cpu_threads"] for m in metrics if "loss" in m] == [2.0, 1.0]
