"""The workflow's keys of the `explorer` section: which workflow turns a task into a group, and its episode limits."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rft.config import COUNT, OPTIONAL, POSITIVE, Section, SectionError, option, section


@dataclass(frozen=True)
class VerifiersOptions(Section):
    """`explorer.workflow: verifiers`: the verifiers environment server (its own venv and process) and its limits
    (rft/workflows/verifiers.py, docs/data.md)."""
    KEY = "explorer.verifiers"
    env: dict[str, Any] = option(factory=dict,
        help="verifiers' EnvConfig as a mapping: taskset.id names the taskset module (required), agent.runtime "
        "where its harness runs (e.g. {type: subprocess}), and the environment's own keys")
    python: str = option(".cache/verifiers/bin/python",
        help="the verifiers venv's interpreter (make hub-envs) that starts the env server")
    pythonpath: list[str] = option(factory=list, help="directories put on the env server's module path")
    address: str = option("",
        help="tcp://HOST:PORT of a running verifiers env server; empty: each explorer starts its own (on a free "
        "loopback port) and stops it when it stops")
    start_timeout_s: float = option(180.0, range=POSITIVE,
        help="how long a started env server may take to bind and answer its first health check")
    episode_timeout_s: float = option(600.0, range=POSITIVE,
        help="one task's n episodes must end within this; the ones still running are cancelled and fail as timeout")
    health_every_s: float = option(5.0, range=POSITIVE,
        help="while no episode frame arrives for this long, the env server must answer a health check (else its "
        "episodes fail as environment)")
    health_timeout_s: float = option(5.0, range=POSITIVE, help="how long a health check waits for its answer")
    max_concurrent: int = option(0, range=OPTIONAL, help="a started env server's episodes in flight; 0: no bound")

    def validate(self) -> None:
        taskset = self.env.get("taskset")
        if self.env and not (isinstance(taskset, dict) and isinstance(taskset.get("id"), str) and taskset["id"]):
            raise SectionError("env", "needs taskset.id: the verifiers taskset module to serve")


@dataclass(frozen=True)
class WorkflowOptions(Section):
    KEY = "explorer"
    workflow: str = option("single_turn",
        help="registered name (single_turn, multi_turn, tool_agent, verifiers) or package.module:Class")
    environment: str = option("retry",
        help="multi_turn: registered environment (retry, frozenlake, textarena) or package.module:Class")
    max_turns: int = option(2, help="multi_turn, tool_agent: model turns per episode", range=COUNT)
    greedy_baseline: bool = option(False,
        help="single_turn, batch loop: also generate one greedy (temperature 0) response per task, score it with the "
        "reward and record its reward as the group's greedy_reward (not trained on); on whenever the algorithm "
        "needs it (remax)")
    verifiers: VerifiersOptions = section(VerifiersOptions)
