"""openenv: episodes of an OpenEnv environment server (`explorer.workflow: openenv`, keys `explorer.openenv`).

OpenEnv (`openenv` 0.10) serves an environment over HTTP and a WebSocket `/ws`; each WebSocket connection is a
session with its own environment instance. Frames are JSON: rft sends `{"type": "reset", "data": {...}}` and
`{"type": "step", "data": {<action_field>: model text}}`, the server answers `{"type": "observation", "data":
{"observation": {...}, "reward": float | null, "done": bool}}` or `{"type": "error", "data": {"message", "code"}}`.
The server runs in its own process and virtual environment (OpenEnv's dependencies conflict with rft's); rft never
imports openenv.

The rollout is multi_turn's (rft/workflows/multi_turn.py): `OpenEnvEnvironment` is one episode, one WebSocket
session. Its reset (data: the task's `reset_key` metadata mapping) gives the prompt, the observation's
`observation_field` text, tokenized by the explorer's engine; each model turn is sent as the step's action and the
observation's text is appended after it (masked out of the loss); the episode ends when the server says `done`, at
`explorer.max_turns`, or when the response budget is spent. The reward is the sum of the steps' rewards; a reward
of None at the episode's end is `unscored` (multi_turn). Each step's state key is a hash of the observation the
model acted on (its `state_field`, or all of it). A server that cannot be reached, closes the session or answers an
error frame fails the rollout as `environment`, one past `step_timeout_s` as `timeout`: the sample is kept with its
failure class and no reward (rft/schema.py `Sample.failure`), never scored 0.

The server is `openenv.url` (running already) or `openenv.command` ({port}: a free port), which the workflow starts
in its own process group when it is built, waits for (`GET /health`), and stops when the process exits.
"""
from __future__ import annotations

import atexit
import hashlib
import json
import logging
import math
import shlex
import subprocess
import time
from typing import TYPE_CHECKING, Any

import httpx
from websockets.exceptions import WebSocketException
from websockets.sync.client import ClientConnection, connect

from rft.processes import die_with_parent, free_port, stop_group
from rft.rewards.registry import TaskError
from rft.workflows.multi_turn import EnvStep, MultiTurn, RolloutFailure
from rft.workflows.registry import WorkflowError, register_workflow

if TYPE_CHECKING:
    from rft.explorer.config import ExplorerConfig
    from rft.models.config import ModelConfig
    from rft.rewards import Reward
    from rft.schema import TaskRecord
    from rft.workflows.config import OpenEnvOptions

log = logging.getLogger(__name__)
MAX_FRAME_BYTES = 4 << 20  # a frame from the server larger than this closes the session (an `environment` failure)


def check_options(options: OpenEnvOptions) -> None:
    """WorkflowError naming the key when `explorer.openenv` says neither where the server is nor how to start it."""
    if not options.url and not options.command:
        raise WorkflowError("explorer.openenv: the openenv workflow needs openenv.url (a running OpenEnv server) or "
                            "openenv.command (one to start, with {port})")


class OpenEnvServer:
    """The server's base URLs: `openenv.url`, or a process `openenv.command` started here (stopped at exit)."""

    def __init__(self, options: OpenEnvOptions):
        check_options(options)
        self.process: subprocess.Popen | None = None
        url = options.url.rstrip("/")
        if options.command:
            url = self._start(options)
        self.http_url = url.replace("ws://", "http://", 1).replace("wss://", "https://", 1)
        self.ws_url = self.http_url.replace("http://", "ws://", 1).replace("https://", "wss://", 1) + "/ws"

    def _start(self, options: OpenEnvOptions) -> str:
        port = free_port()
        command = shlex.split(options.command.replace("{port}", str(port)))
        try:
            self.process = subprocess.Popen(command, start_new_session=True, stdin=subprocess.DEVNULL,
                                            preexec_fn=die_with_parent)
        except OSError as e:
            raise WorkflowError(f"explorer.openenv.command: cannot start {command[0]!r}: {e}") from None
        atexit.register(self.stop)
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + options.start_timeout_s
        while True:
            if self.process.poll() is not None:
                raise WorkflowError(f"explorer.openenv.command: the server exited with status "
                                    f"{self.process.returncode} before answering {url}/health")
            try:
                if httpx.get(f"{url}/health", timeout=2.0).status_code == 200:
                    log.info("OpenEnv server up on %s (pid %d): %s", url, self.process.pid, " ".join(command)[:300])
                    return url
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise WorkflowError(f"explorer.openenv.command: the server did not answer {url}/health within "
                                    f"start_timeout_s={options.start_timeout_s:g}")
            time.sleep(0.2)

    def stop(self) -> None:
        """Stop a started server's process group (idempotent; nothing for `openenv.url`)."""
        if self.process is not None:
            stop_group(self.process, timeout_s=5)


def observation_text(data: Any, field: str) -> str:
    """The text the model reads in an observation frame's `data`; RolloutFailure (environment) naming what is off."""
    observation = data.get("observation") if isinstance(data, dict) else None
    if not isinstance(observation, dict):
        raise RolloutFailure("environment", f"observation frame without an observation mapping: {str(data)[:200]}")
    text = observation.get(field)
    if not isinstance(text, str):
        raise RolloutFailure("environment", f"observation field {field!r} is not a string (explorer.openenv."
                             f"observation_field); fields: {sorted(observation)[:20]}")
    return text


def step_reward(data: dict[str, Any]) -> float | None:
    """The frame's reward: None (unscored) or a finite number; RolloutFailure (environment) for anything else."""
    reward = data.get("reward")
    if reward is None:
        return None
    if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward):
        raise RolloutFailure("environment", f"reward {str(reward)[:64]} is not a finite number or null")
    return float(reward)


def state_key(observation: Any, field: str) -> str:
    """A key of the state an observation shows: the SHA-256 of its `field` (all of it when empty) as canonical JSON."""
    value = observation.get(field) if field and isinstance(observation, dict) else observation
    canonical = json.dumps(value, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(canonical.encode()).hexdigest()


class OpenEnvEnvironment:
    """One episode on its own WebSocket session: reset when built (its `prompt`), `step(model_text)` per model turn.
    Raises RolloutFailure (environment, timeout) when the server fails; TaskError when the task's reset data is not
    a mapping."""

    owns_reward = True

    def __init__(self, server: OpenEnvServer, options: OpenEnvOptions, task: TaskRecord):
        reset = task.metadata.get(options.reset_key, {})
        if not isinstance(reset, dict):
            raise TaskError(f"task metadata {options.reset_key!r} (explorer.openenv.reset_key) must be a mapping of "
                            f"reset data; got {str(reset)[:100]}")
        self.options = options
        self.episode_info = dict(reset)  # sample metadata `environment` (the seed, ...)
        self.ws: ClientConnection | None = None
        try:
            self.ws = connect(server.ws_url, open_timeout=options.connect_timeout_s, max_size=MAX_FRAME_BYTES,
                              close_timeout=1)
        except (OSError, WebSocketException) as e:  # refused, unreachable, a handshake timeout or rejection
            raise RolloutFailure("environment", f"cannot open {server.ws_url}: {e}") from None
        try:
            data = self._exchange({"type": "reset", "data": reset})
            self.prompt = observation_text(data, options.observation_field)
        except RolloutFailure:
            self.close()  # nobody else holds this episode to close it
            raise
        self.state = state_key(data["observation"], options.state_field)

    def _exchange(self, frame: dict[str, Any]) -> dict[str, Any]:
        """Send `frame`, return the answer's `data` (an observation); RolloutFailure for everything else."""
        assert self.ws is not None
        try:
            self.ws.send(json.dumps(frame))
            raw = self.ws.recv(timeout=self.options.step_timeout_s)
        except TimeoutError:
            self.close()
            raise RolloutFailure("timeout", f"no answer to {frame['type']} within explorer.openenv.step_timeout_s="
                                 f"{self.options.step_timeout_s:g}") from None
        except (OSError, WebSocketException) as e:  # the server closed the session or went away
            self.close()
            raise RolloutFailure("environment", f"{frame['type']}: the session ended: {e}") from None
        try:
            answer = json.loads(raw)
        except (ValueError, UnicodeDecodeError):
            raise RolloutFailure("environment", f"{frame['type']}: the answer is not JSON: {raw[:100]!r}") from None
        kind = answer.get("type") if isinstance(answer, dict) else None
        data = answer.get("data") if isinstance(answer, dict) else None
        if kind == "error":
            message = data.get("message") if isinstance(data, dict) else data
            raise RolloutFailure("environment", f"{frame['type']}: the server answered an error: {str(message)[:300]}")
        if kind != "observation" or not isinstance(data, dict):
            raise RolloutFailure("environment", f"{frame['type']}: expected an observation frame, got "
                                 f"{str(answer)[:200]}")
        return data

    def step(self, model_text: str) -> EnvStep:
        data = self._exchange({"type": "step", "data": {self.options.action_field: model_text}})
        done = data.get("done")
        if not isinstance(done, bool):
            raise RolloutFailure("environment", f"step: `done` is {str(done)[:20]}, not true or false")
        text = observation_text(data, self.options.observation_field)
        self.state = state_key(data["observation"], self.options.state_field)
        return EnvStep(text, done=done, reward=step_reward(data))

    def state_key(self) -> str:
        """The key of the state the model acts from next (the last observation's)."""
        return self.state

    def close(self) -> None:
        if self.ws is not None:
            ws, self.ws = self.ws, None
            ws.close()


@register_workflow("openenv")
class OpenEnv(MultiTurn):
    """multi_turn's rollout with every episode an `OpenEnvEnvironment` on the configured server (module docstring)."""

    def __init__(self, explorer: ExplorerConfig, model: ModelConfig, reward: Reward):
        super().__init__(explorer, model, reward)
        options = explorer.openenv
        self.server = OpenEnvServer(options)
        self.environment_cls = lambda task, _reward: OpenEnvEnvironment(self.server, options, task)
        self.environment_owns_reward = True
