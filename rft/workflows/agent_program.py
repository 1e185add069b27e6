"""agent_program: train an agent program the user already wrote (any process that calls an OpenAI-compatible chat
API), by running it against the explorer's recording endpoint (rft/workflows/endpoint.py) and training on the calls
it made.

Episode: for each task, `explorer.n_samples` runs of `explorer.agent_command` (at most `explorer.agent_max_programs`
at once per explorer; their calls are batched into the engine's calls), each:
- with the task as one JSON object on stdin (also in the file $RFT_TASK_FILE): `{"task_id", "epoch", "prompt",
  "answer", "metadata", "episode"}`; OPENAI_BASE_URL (http://127.0.0.1:PORT/v1) and OPENAI_API_KEY (the episode's
  key) in its environment, so the official `openai` client needs no setup; working directory `explorer.agent_dir`;
- under the python tool's sandbox rules (`explorer.python_sandbox`; `sandboxed_program` below): a scrubbed
  environment (no variable of the explorer's: no credentials), no network but its own loopback (the endpoint reaches
  it through a Unix socket bound into the sandbox and a forwarder on 127.0.0.1, rft/workflows/agent_wrapper.py),
  the filesystem read-only but for a working directory of its own ($HOME, $TMPDIR) and a private /tmp, its
  processes killed when it ends; resource limits (address space `explorer.agent_memory_mb`, CPU seconds, 1 MiB per
  file written, processes). With `python_sandbox: none` only the environment is scrubbed (trusted programs only);
- within `explorer.agent_timeout_s` wall seconds, after which it and everything it started are killed.
Result: the program's last stdout line that is a JSON object with `reward` or `answer`:
  `{"reward": x}`       the episode's reward (a finite number; null: unscored, never 0);
  `{"answer": "text"}`  scored by the run's reward (`explorer.reward`) against the task, or by the registered
                        per-response reward it names: `{"answer": "...", "verifier": "math_answer"}` (registered names
                        only, never an import path: the program is not trusted to name code).
Failures (the samples keep their tokens, `failure` set, reward nil, left out of the group's baseline):
  `timeout` past agent_timeout_s; `sandbox` when the sandbox refused to start it; `agent` for a non-zero exit, no
  result line, a reward that is not a finite number, an unknown verifier, or no model call at all; `unscored` for
  `{"reward": null}`; `verifier` when the named verifier raised. A verifier's TaskError (the task's answer cannot be
  scored) makes the group an error, as in every workflow.
Samples: the episode's recorded calls stitched into one sample per branch (rft/workflows/recording.py: the engine's
token ids and log-probs, loss_mask 0 on what the program added between calls, `turns` one per call), each with the
episode's reward; an episode without a call is one sample of the task's prompt and no response (a failure).
Metadata: `episode`, `branch`, `branches`, `calls`, `exit_status`, and `error` (why it failed) for a failure.
"""
from __future__ import annotations

import json
import logging
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import weakref
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from rft.agent_tools import ToolError, ToolLimits
from rft.agent_tools import python as tool
from rft.agent_tools.sandbox import WORKDIR, ProcessLimits, limited, sandboxed
from rft.processes import signal_group
from rft.rewards import REWARDS, FunctionReward, resolve
from rft.rewards.registry import RewardResult, TaskError
from rft.schema import Sample, TaskRecord
from rft.text.chat import ChatPrompt
from rft.workflows.agent_requests import EndpointSettings, Episode
from rft.workflows.endpoint import RecordingEndpoint
from rft.workflows.recording import RecordedCall, branch_sample, episode_branches
from rft.workflows.registry import GroupResult, WorkflowError, encode_prompt, register_workflow

if TYPE_CHECKING:
    from rft.engine import Engine
    from rft.explorer.config import ExplorerConfig
    from rft.models.config import ModelConfig
    from rft.rewards import Reward

log = logging.getLogger(__name__)

WRAPPER = str(Path(__file__).with_name("agent_wrapper.py"))
PROCESSES_PER_PROGRAM = 64  # processes and threads one program may run (the sandbox user's limit is this x programs)
OUTPUT_TAIL = 64 << 10  # bytes of a program's stdout read for its result line


@dataclass(frozen=True)
class SandboxedCommand:
    """How to start a program in the sandbox: its command line (limits and sandbox included), environment, and the
    working directory of the process that starts it."""
    argv: list[str]
    env: dict[str, str]
    cwd: str


def sandboxed_program(command: list[str], *, inputs: str, program_dir: str, socket_dir: str,
                      limits: ToolLimits) -> SandboxedCommand:
    """The python tool's sandbox (rft/agent_tools/sandbox.py) for an agent program: `command` under `limits` in the
    sandbox `limits.sandbox`, started in `program_dir`; read-only: the interpreter, `program_dir`, `inputs` (the
    task file), `socket_dir` (the endpoint's Unix socket) and this package (the wrapper); writable: the sandbox's own
    /tmp ($HOME, $TMPDIR; `explorer.python_workdir_mb`); an environment of its own (nothing inherited). The one place
    this workflow couples to the sandbox."""
    process_limits = ProcessLimits(math.ceil(limits.timeout_s) + 1, limits.memory_mb << 20,
                                   tool.process_limit(limits))
    env = {**tool.TOOL_ENVIRONMENT, "PATH": f"{os.path.dirname(sys.executable)}:/usr/local/bin:/usr/bin:/bin"}
    if limits.sandbox == "none":
        return SandboxedCommand(limited(command, process_limits), {**env, "HOME": inputs, "TMPDIR": inputs},
                                program_dir)
    ro_paths = [*tool.interpreter_paths(), *(os.path.realpath(p) for p in (program_dir, inputs, socket_dir,
                                                                             os.path.dirname(WRAPPER)))]
    argv = sandboxed(command, process_limits, workdir_bytes=limits.workdir_mb << 20, ro_paths=ro_paths)
    argv[argv.index("--chdir") + 1] = os.path.realpath(program_dir)  # the program runs where it lives
    return SandboxedCommand(argv, {**env, "HOME": WORKDIR, "TMPDIR": WORKDIR}, "/")


@dataclass
class _Outcome:
    """How one episode ended: its calls, reward (or failure and why), components, exit status."""
    calls: list[RecordedCall]
    reward: float = 0.0
    components: dict[str, float] = field(default_factory=dict)
    failure: str = ""
    error: str = ""
    exit_status: int | None = None
    task_error: str = ""  # the verifier's TaskError: the group is an error


@dataclass
class _Program:
    """One running episode: its task, the endpoint's episode, the process and its files."""
    task_index: int
    episode_index: int
    episode: Episode
    process: subprocess.Popen
    root: str  # a directory of the explorer's: the program's stdout and stderr
    workdir: str  # the program's working directory (its $HOME), the sandbox's one writable directory
    deadline: float
    started_fd: int  # the pipe the wrapper writes a byte into once it runs (the program cannot take that back)
    timed_out: bool = False

    def started(self) -> bool:
        """Whether the wrapper ran in the sandbox (read once the process has ended)."""
        try:
            return os.read(self.started_fd, 1) == b"1"
        except OSError:
            return False

    def done(self) -> bool:
        if self.process.poll() is not None:
            return True
        if time.monotonic() > self.deadline:
            self.timed_out = True
            self.kill()
            return True
        return False

    def kill(self) -> None:
        signal_group(self.process, signal.SIGKILL)
        self.process.wait()

    def remove(self) -> None:
        try:
            os.close(self.started_fd)
        except OSError:
            pass
        shutil.rmtree(self.root, ignore_errors=True)
        shutil.rmtree(self.workdir, ignore_errors=True)


def check_config(explorer: ExplorerConfig) -> str:
    """The program's directory (absolute); WorkflowError naming the key when the command or the directory is
    missing."""
    if not explorer.agent_command:
        raise WorkflowError("explorer.agent_command: the agent_program workflow needs the program's command line, "
                            "e.g. [python, examples/agents/calculator_agent.py]")
    program_dir = os.path.abspath(explorer.agent_dir or ".")
    if not os.path.isdir(program_dir):
        raise WorkflowError(f"explorer.agent_dir: {program_dir} is not a directory")
    return program_dir


@register_workflow("agent_program")
class AgentProgram:
    def __init__(self, explorer: ExplorerConfig, model: ModelConfig, reward: Reward):
        if not model.chat_template:
            raise WorkflowError("model.chat_template: the agent_program workflow serves a chat API; set "
                                "model.chat_template: true")
        self.program_dir = check_config(explorer)
        self.command = list(explorer.agent_command)
        self.limits = ToolLimits(timeout_s=explorer.agent_timeout_s, memory_mb=explorer.agent_memory_mb,
                                 sandbox=explorer.python_sandbox, workdir_mb=explorer.python_workdir_mb,
                                 max_processes=PROCESSES_PER_PROGRAM * explorer.agent_max_programs)
        try:
            tool.check_sandbox(explorer.python_sandbox)
        except ToolError as e:
            raise WorkflowError(str(e)) from None
        self.n, self.max_programs, self.timeout_s = explorer.n_samples, explorer.agent_max_programs, \
            explorer.agent_timeout_s
        self.settings = EndpointSettings.of(explorer, model, max_calls=explorer.agent_max_calls)
        self.chat, self.max_prompt_len, self.reward = ChatPrompt.of(model), model.max_prompt_len, reward
        self._endpoint: RecordingEndpoint | None = None
        self._socket_dir = ""

    def endpoint(self) -> RecordingEndpoint:
        """The recording endpoint on a Unix socket, started on first use and kept for the workflow's life."""
        if self._endpoint is None:
            self._socket_dir = tempfile.mkdtemp(prefix="rft-agent-endpoint-")
            os.chmod(self._socket_dir, 0o755)
            path = os.path.join(self._socket_dir, "endpoint.sock")
            self._endpoint = RecordingEndpoint(self.settings, uds=path).start()
            os.chmod(path, 0o666)  # the sandbox's user connects to it
            self._closer = weakref.finalize(self, _stop, self._endpoint, self._socket_dir)
        return self._endpoint

    def close(self) -> None:
        """Stop the endpoint and remove its socket (also done when the workflow is collected, or at exit)."""
        if self._endpoint is not None:
            self._closer()
            self._endpoint = None

    def explore(self, tasks: Sequence[TaskRecord], engine: Engine) -> list[GroupResult]:
        endpoint = self.endpoint()
        pending = deque((i, k) for i in range(len(tasks)) for k in range(self.n))
        running: list[_Program] = []
        outcomes: dict[tuple[int, int], _Outcome] = {}

        def step() -> bool:
            for program in [p for p in running if p.done()]:
                running.remove(program)
                outcomes[program.task_index, program.episode_index] = self._finish(program, tasks[program.task_index])
            while pending and len(running) < self.max_programs:
                i, k = pending.popleft()
                started = self._start(endpoint, tasks[i], i, k)
                if isinstance(started, _Outcome):
                    outcomes[i, k] = started
                else:
                    running.append(started)
            return not pending and not running

        try:
            endpoint.pump(engine, until=step)
        finally:
            for program in running:
                program.kill()
                endpoint.close_episode(program.episode)
                program.remove()
        return [self._group(task, [outcomes[i, k] for k in range(self.n)], engine) for i, task in enumerate(tasks)]

    def _start(self, endpoint: RecordingEndpoint, task: TaskRecord, i: int, k: int) -> _Program | _Outcome:
        root, workdir = tempfile.mkdtemp(prefix="rft-agent-"), tempfile.mkdtemp(prefix="rft-agent-task-")
        os.chmod(workdir, 0o755)  # the sandbox's user reads the task file
        task_file = os.path.join(workdir, "task.json")
        Path(task_file).write_text(json.dumps({"task_id": task.task_id, "epoch": task.epoch, "prompt": task.prompt,
                                               "answer": task.answer, "metadata": task.metadata, "episode": k},
                                              default=str))
        episode = endpoint.open_episode()
        socket_path = endpoint.uds or ""
        os.chmod(task_file, 0o644)
        started_read, started_write = os.pipe()  # the wrapper writes a byte once the sandbox has started it
        command = [tool.interpreter(), "-I", WRAPPER, socket_path, str(started_write), "--", *self.command]
        sandboxed = sandboxed_program(command, inputs=workdir, program_dir=self.program_dir,
                                      socket_dir=os.path.dirname(socket_path), limits=self.limits)
        env = {**sandboxed.env, "OPENAI_API_KEY": episode.key, "RFT_TASK_FILE": task_file}
        try:
            with open(task_file, "rb") as stdin, open(os.path.join(root, "stdout"), "wb") as out, \
                    open(os.path.join(root, "stderr"), "wb") as err:
                process = subprocess.Popen(sandboxed.argv, stdin=stdin, stdout=out, stderr=err, cwd=sandboxed.cwd,
                                           env=env, start_new_session=True, pass_fds=(started_write,))
        except OSError as e:
            os.close(started_read)
            endpoint.close_episode(episode)
            shutil.rmtree(root, ignore_errors=True)
            shutil.rmtree(workdir, ignore_errors=True)
            return _Outcome([], failure="sandbox", error=f"cannot start {sandboxed.argv[0]}: {e}")
        finally:
            os.close(started_write)
        return _Program(i, k, episode, process, root, workdir, time.monotonic() + self.timeout_s, started_read)

    def _finish(self, program: _Program, task: TaskRecord) -> _Outcome:
        calls = self.endpoint().close_episode(program.episode)
        try:
            outcome = self._outcome(program, calls, task)
        finally:
            program.remove()
        if outcome.failure:
            log.warning("agent program episode %d of task %s: %s (%s)", program.episode_index, task.task_id,
                        outcome.failure, outcome.error)
        return outcome

    def _outcome(self, program: _Program, calls: list[RecordedCall], task: TaskRecord) -> _Outcome:
        status = program.process.returncode
        stderr = _tail(os.path.join(program.root, "stderr"), 600)
        outcome = _Outcome(calls, exit_status=status)
        if program.timed_out:
            outcome.failure, outcome.error = "timeout", f"still running after {self.timeout_s:g} s"
        elif not program.started():
            outcome.failure, outcome.error = "sandbox", f"the sandbox did not start it: {stderr}"
        elif status != 0:
            outcome.failure, outcome.error = "agent", f"exit status {status}: {stderr}"
        else:
            self._score(outcome, _result_line(_tail(os.path.join(program.root, "stdout"), OUTPUT_TAIL)), task)
        if not outcome.failure and not outcome.task_error and not calls:
            outcome.failure, outcome.error = "agent", "the program made no model call"
        return outcome

    def _score(self, outcome: _Outcome, result: dict[str, Any] | None, task: TaskRecord) -> None:
        """The episode's reward from the program's result line (module docstring), or its failure."""
        if result is None:
            outcome.failure, outcome.error = "agent", 'no result line ({"reward": x} or {"answer": "..."}) on stdout'
            return
        if "reward" in result:
            value = result["reward"]
            if value is None:
                outcome.failure, outcome.error = "unscored", "the program's reward is null"
            elif isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                outcome.failure, outcome.error = "agent", f"reward {json.dumps(value)[:40]} is not a finite number"
            else:
                outcome.reward = float(value)
            return
        answer, name = result.get("answer"), result.get("verifier")
        if not isinstance(answer, str):
            outcome.failure, outcome.error = "agent", "answer must be a string"
            return
        reward = self.reward
        if name is not None:
            if not isinstance(name, str) or name not in REWARDS or resolve(name)[0] != "function":
                outcome.failure, outcome.error = "agent", (f"verifier {str(name)[:60]!r} is not a registered "
                                                           "per-response reward")
                return
            reward = FunctionReward(name, resolve(name)[1])
        try:
            scored: RewardResult = reward.score([answer], task)[0]
        except TaskError as e:
            outcome.task_error = f"task cannot be scored: {e}"
            return
        except Exception as e:  # noqa: BLE001  (a verifier's crash is this episode's failure, not the explorer's)
            outcome.failure, outcome.error = "verifier", f"{type(e).__name__}: {e}"[:300]
            return
        outcome.reward, outcome.components = scored.score, dict(scored.components)

    def _group(self, task: TaskRecord, outcomes: list[_Outcome], engine: Engine) -> GroupResult:
        errors = [o.task_error for o in outcomes if o.task_error]
        if errors:
            return GroupResult(task, error=errors[0])
        samples: list[Sample] = []
        versions = [c.weights_version for o in outcomes for c in o.calls]
        for k, o in enumerate(outcomes):
            meta = {"episode": k, "calls": len(o.calls), "exit_status": o.exit_status,
                    **({"error": o.error[:300]} if o.failure else {})}
            components = {**o.components, "calls": float(len(o.calls))}
            if not o.calls:
                prompt = encode_prompt(engine, task, self.max_prompt_len, self.chat)
                samples.append(Sample(
                    len(samples), np.asarray([] if isinstance(prompt, str) else prompt, dtype=np.int32),
                    np.zeros(0, np.int32), np.zeros(0, np.float32), np.zeros(0, np.uint8), 0.0, components,
                    finish_reason="abort", metadata={**meta, "branch": 0, "branches": 1}, failure=o.failure))
                continue
            branches = episode_branches(o.calls)
            for b, branch in enumerate(branches):
                samples.append(branch_sample(o.calls, branch, len(samples), reward=o.reward, components=components,
                                             failure=o.failure,
                                             metadata={**meta, "branch": b, "branches": len(branches)}))
        return GroupResult(task, samples=samples, policy_version=min(versions, default=engine.weights_version))


def _stop(endpoint: RecordingEndpoint, socket_dir: str) -> None:
    endpoint.stop()
    shutil.rmtree(socket_dir, ignore_errors=True)


def _tail(path: str, limit: int) -> str:
    """The last `limit` bytes of a file, as text ("" when it cannot be read)."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.path.getsize(path) - limit))
            return f.read().decode("utf-8", "replace").strip()
    except OSError:
        return ""


def _result_line(output: str) -> dict[str, Any] | None:
    """The last line of `output` that is a JSON object with `reward` or `answer`, None when there is none."""
    for line in reversed(output.splitlines()):
        line = line.strip()
        if not line.startswith("{"):
            continue
        try:
            value = json.loads(line)
        except ValueError:
            continue
        if isinstance(value, dict) and ("reward" in value or "answer" in value):
            return value
    return None
