"""verifiers task sets (`data.format: verifiers`) and the verifiers venv's processes: rft's explorer owns the task
stream, so a verifiers taskset's tasks are read once, by verifiers itself in its own venv (rft/data/verifiers_host.py
`tasks`), and published to the run's tasks topic like any task set's rows.

`data.path` is the taskset id (the module verifiers imports: a package of the verifiers venv, or a module on
`pythonpath`); `data.options` holds `python` (the verifiers venv's interpreter, default .cache/verifiers/bin/python),
`pythonpath` (directories put on its path), `env` (the rest of verifiers' EnvConfig, e.g. `{agent: {runtime: {type:
subprocess}}}`) and `taskset` (the taskset's own config keys). `data.generated_tasks` bounds how many are read.
Row i: `prompt` the task's prompt text (for the record; the environment renders its own), `verifiers` the task's
TaskData as verifiers dumped it (what the env server is sent back), validated as a JSON mapping of bounded size.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

METADATA_KEY = "verifiers"  # a task's TaskData in its metadata
HOST_SCRIPT = Path(__file__).with_name("verifiers_host.py")
DEFAULT_PYTHON = ".cache/verifiers/bin/python"  # `make hub-envs`
MAX_TASK_BYTES = 1 << 20  # one TaskData's JSON


class VerifiersError(ValueError):
    """The verifiers venv or its environment cannot be used as configured; `key` names the option at fault."""

    def __init__(self, message: str, *, key: str = "options"):
        super().__init__(message)
        self.key = key


@dataclass(frozen=True)
class VerifiersHost:
    """How rft starts verifiers' processes: the venv's interpreter, extra module directories, and the EnvConfig (a
    JSON mapping: `taskset.id` names the taskset)."""
    python: str = DEFAULT_PYTHON
    pythonpath: tuple[str, ...] = ()
    env: dict[str, Any] = field(default_factory=dict)

    @property
    def taskset_id(self) -> str:
        taskset = self.env.get("taskset")
        return str(taskset.get("id", "")) if isinstance(taskset, dict) else ""

    def command(self, mode: str, *args: str) -> list[str]:
        """The argv of verifiers_host.py in `mode`; VerifiersError when the interpreter is missing."""
        if not os.access(self.python, os.X_OK):
            raise VerifiersError(f"python: the verifiers venv's interpreter {self.python} is missing: run `make "
                                 f"hub-envs` (requirements/verifiers.txt)", key="python")
        # -P: the script's directory (rft/data, whose selectors.py would shadow the standard library's) stays off
        # the module path
        return [self.python, "-P", str(HOST_SCRIPT), mode, "--env", json.dumps(self.env), *args]

    def environ(self) -> dict[str, str]:
        """The process environment: this one's, less rft's own python path, plus `pythonpath`."""
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
        if self.pythonpath:
            env["PYTHONPATH"] = os.pathsep.join(str(Path(p).resolve()) for p in self.pythonpath)
        return env


def host_from_options(taskset_id: str, options: dict[str, Any]) -> VerifiersHost:
    """The host `data.options` describe for the taskset `taskset_id` (module doc); VerifiersError naming the key."""
    unknown = set(options) - {"python", "pythonpath", "env", "taskset"}
    if unknown:
        raise VerifiersError(f"unknown keys {sorted(unknown)} (verifiers: python, pythonpath, env, taskset)")
    python, pythonpath = options.get("python", DEFAULT_PYTHON), options.get("pythonpath", [])
    env, taskset = options.get("env", {}), options.get("taskset", {})
    if not isinstance(python, str) or not isinstance(pythonpath, list) or not all(isinstance(p, str)
                                                                                  for p in pythonpath):
        raise VerifiersError("python must be a path and pythonpath a list of directories")
    if not isinstance(env, dict) or not isinstance(taskset, dict):
        raise VerifiersError("env and taskset must be mappings (verifiers' EnvConfig and its taskset's keys)")
    if not taskset_id:
        raise VerifiersError("the taskset id is required (the module verifiers imports)", key="path")
    return VerifiersHost(python, tuple(pythonpath), {**env, "taskset": {**taskset, "id": taskset_id}})


def verifiers_rows(host: VerifiersHost, *, limit: int, timeout_s: float = 300.0) -> list[dict[str, Any]]:
    """The first `limit` tasks of the host's taskset as rows (module doc), read by verifiers in its venv."""
    try:
        done = subprocess.run(host.command("tasks", "--limit", str(limit)), env=host.environ(), capture_output=True,
                              text=True, timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired:
        raise VerifiersError(f"reading taskset {host.taskset_id!r} took over {timeout_s:.0f} s", key="path") from None
    if done.returncode != 0:
        tail = done.stderr.strip().splitlines()[-5:]
        raise VerifiersError(f"verifiers could not load taskset {host.taskset_id!r} (exit {done.returncode}): "
                             + " | ".join(tail), key="path")
    rows = []
    for n, line in enumerate(done.stdout.splitlines()):
        if len(line) > MAX_TASK_BYTES:
            raise VerifiersError(f"task {n} of {host.taskset_id!r} is over {MAX_TASK_BYTES} bytes", key="path")
        data = json.loads(line)
        if not isinstance(data, dict):
            raise VerifiersError(f"task {n} of {host.taskset_id!r} is not a mapping", key="path")
        rows.append({"prompt": prompt_text(data.get("prompt")), "answer": None, METADATA_KEY: data})
    if not rows:
        raise VerifiersError(f"taskset {host.taskset_id!r} has no tasks", key="path")
    return rows


def prompt_text(prompt: Any) -> str:
    """A TaskData prompt (a string, chat messages or None) as text, for the task record."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list):
        return "\n\n".join(str(m.get("content") or "") for m in prompt if isinstance(m, dict))
    return ""


def start_server(host: VerifiersHost, *, address: str = "tcp://127.0.0.1:0", max_concurrent: int = 0,
                 log: Path | None = None) -> subprocess.Popen[str]:
    """Start verifiers' env server in its venv (verifiers_host.py `serve`); read its address with `server_address`.
    Its stderr goes to `log` (appended) or to this process's stderr."""
    stderr = open(log, "a") if log is not None else sys.stderr  # noqa: SIM115  (the child holds it)
    try:
        return subprocess.Popen(host.command("serve", "--address", address, "--max-concurrent", str(max_concurrent)),
                                env=host.environ(), stdout=subprocess.PIPE, stderr=stderr, text=True,
                                start_new_session=True)
    finally:
        if log is not None:
            stderr.close()


def server_address(process: subprocess.Popen[str]) -> str:
    """The address a started server bound (its first stdout line); VerifiersError when it exited first. Blocks until
    the line comes: the caller bounds the wait (the process is killed past it, which ends the read)."""
    assert process.stdout is not None
    line = process.stdout.readline()
    if not line.startswith("address "):
        process.wait()
        raise VerifiersError(f"the verifiers env server exited ({process.returncode}) before it served",
                             key="env")
    return line.split(" ", 1)[1].strip()
