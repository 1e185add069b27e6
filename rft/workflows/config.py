"""The workflow's keys of the `explorer` section: which workflow turns a task into a group, and its episode limits."""
from __future__ import annotations

from dataclasses import dataclass

from rft.config import COUNT, POSITIVE, Section, at_least, option


@dataclass(frozen=True)
class WorkflowOptions(Section):
    KEY = "explorer"
    workflow: str = option("single_turn",
        help="registered name (single_turn, multi_turn, tool_agent, agent_program) or package.module:Class")
    environment: str = option("retry",
        help="multi_turn: registered environment (retry, frozenlake, textarena) or package.module:Class")
    max_turns: int = option(2, help="multi_turn, tool_agent: model turns per episode", range=COUNT)
    greedy_baseline: bool = option(False,
        help="single_turn, batch loop: also generate one greedy (temperature 0) response per task, score it with the "
        "reward and record its reward as the group's greedy_reward (not trained on); on whenever the algorithm "
        "needs it (remax)")


@dataclass(frozen=True)
class AgentProgramOptions(Section):
    """The agent_program workflow's keys: the user's program and its limits (rft/workflows/agent_program.py)."""
    KEY = "explorer"
    agent_command: list[str] = option(factory=list,
        help="agent_program: the agent program's command line, e.g. [python, examples/agents/calculator_agent.py]; "
        "run in agent_dir with the task as JSON on stdin and OPENAI_BASE_URL / OPENAI_API_KEY naming the explorer's "
        "recording endpoint (docs/data.md, Training your own agent program)")
    agent_dir: str = option("",
        help="agent_program: the program's directory, its working directory (read-only in the sandbox); empty: the "
        "explorer's working directory")
    agent_timeout_s: float = option(300.0, range=POSITIVE,
        help="agent_program: wall-clock limit of one episode (its program and everything it started are killed "
        "past it: a timeout failure)")
    agent_max_programs: int = option(8, range=COUNT,
        help="agent_program: programs an explorer runs at once (their model calls are batched into one engine call)")
    agent_max_calls: int = option(64, range=COUNT,
        help="agent_program: model calls one episode may make (more are refused)")
    agent_memory_mb: int = option(4096, range=at_least(256),
        help="agent_program: address-space limit of the program's processes (each)")
