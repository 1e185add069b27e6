"""The core board applied once around the engine (rft/engine/paced.py) on a real board file (rft/cores.py): the
explorer's part is busy exactly while its engine computes (a whole `workflow.explore`, with every generate inside it;
one engine step; a reload), waiting otherwise, busy on while requests are unfinished; the board's threads are fitted
before generating and stepping, never before a reload. The engine and workflow are in-memory stand-ins of our own
protocols that read the board while they compute."""
from __future__ import annotations

from rft.cores import CoreShare, write_board
from rft.engine.paced import PacedStreamingEngine, paced


class Board:
    """The real board of two parts (the trainer, the explorer: a thread each), read as the trainer sees it."""

    def __init__(self, tmp_path):
        env = write_board(tmp_path / "board", {"trainer": (1, 1), "explorer": (1, 1)})
        self.explorer = CoreShare.from_environment({CoreShare.ENV: env["explorer"]})
        self.trainer = CoreShare.from_environment({CoreShare.ENV: env["trainer"]})
        self.fitted: list[int] = []  # what each fit_torch applied
        fit = self.explorer.fit_torch
        self.explorer.fit_torch = lambda set_threads=None: self.fitted.append(fit(lambda n: None))  # not torch's pool

    def explorer_busy(self) -> bool:
        return self.trainer.threads() == 1  # the trainer borrows the explorer's thread only while it waits


class StandInEngine:
    """Engine protocol (request-level too), in memory: records whether the explorer was busy in each call."""

    def __init__(self, board: Board):
        self.board, self.weights_version, self.seen, self.pending = board, 0, [], 0

    def generate(self, prompts, sampling):
        self.seen.append(("generate", self.board.explorer_busy()))
        return []

    def generate_images(self, prompts, sampling):
        self.seen.append(("generate images", self.board.explorer_busy()))
        return []

    def load_weights(self, path, version):
        self.seen.append(("load", self.board.explorer_busy()))
        self.weights_version = version

    def submit(self, request_id, prompt, sampling):
        self.pending += 1

    def step(self):
        self.seen.append(("step", self.board.explorer_busy()))
        self.pending -= 1
        return []

    def unfinished(self):
        return self.pending

    def load_weights_in_flight(self, path, version, *, recompute):
        self.seen.append(("load in flight", self.board.explorer_busy()))


class TwoTurnWorkflow:
    """Workflow protocol, in memory: two generates with a pause between them (a multi-turn workflow)."""

    def __init__(self, board: Board):
        self.board, self.between = board, []

    def explore(self, tasks, engine):
        engine.generate([[1]], None)
        self.between.append(self.board.explorer_busy())
        engine.generate([[1]], None)
        return []


def test_the_explorer_is_busy_while_its_engine_computes(tmp_path):
    board = Board(tmp_path)
    inner = StandInEngine(board)
    engine, workflow = paced(inner, TwoTurnWorkflow(board), board.explorer)
    assert isinstance(engine, PacedStreamingEngine)
    board.explorer.set_busy(False)

    workflow.explore([], engine)  # one unit: busy between the turns too, threads fitted once
    assert inner.seen == [("generate", True), ("generate", True)] and workflow.workflow.between == [True]
    assert not board.explorer_busy() and len(board.fitted) == 1

    engine.generate_images([], None)  # image prompts (a vision-language model) compute as generates do
    assert inner.seen[-1] == ("generate images", True) and not board.explorer_busy() and len(board.fitted) == 2
    engine.load_weights("v1", 1)  # a reload computes, on the threads the explorer holds
    assert inner.seen[-1] == ("load", True) and not board.explorer_busy() and len(board.fitted) == 2

    engine.submit("a", [1], None)
    engine.submit("b", [1], None)
    engine.step()  # "b" is still unfinished: the explorer computes on
    assert inner.seen[-1] == ("step", True) and board.explorer_busy() and len(board.fitted) == 3
    engine.load_weights_in_flight("v2", 2, recompute=True)
    assert inner.seen[-1] == ("load in flight", True) and board.explorer_busy()
    engine.step()  # nothing unfinished after it: waiting
    assert not board.explorer_busy() and len(board.fitted) == 4
