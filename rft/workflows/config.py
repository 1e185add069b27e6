"""The workflow's keys of the `explorer` section: which workflow turns a task into a group, and its episode limits."""
from __future__ import annotations

from dataclasses import dataclass

from rft.config import COUNT, Section, option


@dataclass(frozen=True)
class WorkflowOptions(Section):
    KEY = "explorer"
    workflow: str = option("single_turn",
        help="registered name (single_turn, multi_turn, tool_agent) or package.module:Class")
    environment: str = option("retry",
        help="multi_turn: registered environment (retry, frozenlake, textarena) or package.module:Class")
    max_turns: int = option(2, help="multi_turn, tool_agent: model turns per episode", range=COUNT)
    greedy_baseline: bool = option(False,
        help="single_turn, batch loop: also generate one greedy (temperature 0) response per task, score it with the "
        "reward and record its reward as the group's greedy_reward (not trained on); on whenever the algorithm "
        "needs it (remax)")
