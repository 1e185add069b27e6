"""The workflow's keys of the `explorer` section: which workflow turns a task into a group, and its episode limits;
`explorer.openenv`: the server the `openenv` workflow plays its episodes on (rft/workflows/openenv_adapter.py)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rft.config import COUNT, OPTIONAL, POSITIVE, Section, SectionError, at_least, option, section


@dataclass(frozen=True)
class OpenEnvOptions(Section):
    """Where the `openenv` workflow's environment server is (a URL, or a command each explorer starts) and which
    fields of OpenEnv's actions and observations carry the text (docs/data.md, "Training an OpenEnv environment")."""
    KEY = "explorer.openenv"
    url: str = option("",
        help="openenv workflow: base URL of a running OpenEnv server (http://host:port or ws://host:port; episodes "
        "are played over its WebSocket /ws); empty: `command` starts one")
    command: str = option("",
        help="openenv workflow: command (shell words, {port}: a free port) that starts the server on 127.0.0.1; "
        "each explorer (and rft eval) starts its own, waits for its /health, and stops it on exit. Relative paths "
        "resolve in the working directory")
    start_timeout_s: float = option(120.0, range=POSITIVE,
        help="openenv workflow: seconds a started server has to answer /health (the explorer refuses to start)")
    connect_timeout_s: float = option(10.0, range=POSITIVE,
        help="openenv workflow: seconds to open an episode's WebSocket; past it (or refused) the rollout fails as "
        "`environment`")
    step_timeout_s: float = option(30.0, range=POSITIVE,
        help="openenv workflow: seconds the server has to answer a reset or a step; past it the rollout fails as "
        "`timeout` (kept, not trained)")
    reset_key: str = option("openenv",
        help="openenv workflow: the task metadata field whose mapping is the reset data (seed, options; absent: "
        "{}); `frozenlake` plays rft's generated frozenlake tasks")
    action_field: str = option("message",
        help="openenv workflow: the action field that carries the model's text ({field: text})")
    observation_field: str = option("text",
        help="openenv workflow: the observation field (a string) the model reads: the reset's is the prompt, a "
        "step's is appended after the model's turn")
    state_field: str = option("",
        help="openenv workflow: the observation field whose value keys the state the model acts from (a sample's "
        "turns: GiGPO's anchor states); empty: the whole observation")

    def validate(self) -> None:
        if self.url and self.command:
            raise SectionError("url", "set openenv.url (a running server) or openenv.command (one to start), not both")
        if self.url and not self.url.startswith(("http://", "https://", "ws://", "wss://")):
            raise SectionError("url", f"must start with http://, https://, ws:// or wss://; got {self.url!r}")
        if self.command and "{port}" not in self.command:
            raise SectionError("command", f"must contain {{port}} (the port the server listens on); got "
                               f"{self.command!r}")


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
        help="registered name (single_turn, multi_turn, tool_agent, openenv, agent_program, verifiers) or "
        "package.module:Class")
    environment: str = option("retry",
        help="multi_turn: registered environment (retry, frozenlake, textarena) or package.module:Class")
    max_turns: int = option(2, help="multi_turn, tool_agent, openenv: model turns per episode", range=COUNT)
    greedy_baseline: bool = option(False,
        help="single_turn, batch loop: also generate one greedy (temperature 0) response per task, score it with the "
        "reward and record its reward as the group's greedy_reward (not trained on); on whenever the algorithm "
        "needs it (remax)")
    openenv: OpenEnvOptions = section(OpenEnvOptions)
    verifiers: VerifiersOptions = section(VerifiersOptions)


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
