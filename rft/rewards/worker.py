"""A reward worker process (`python -m rft.rewards.worker`, started by rft/rewards/limits.py `RewardWorkers`).

Reads msgpack frames `{"reward": spec, "response": text, "task": {TaskRecord's fields}}` from stdin and answers each
on stdout with `{"score", "components", "failure"}` (the reward's checked result; `failure` "verifier" with a
`message` when it raised, "unscored" when it returned None), `{"task_error": message}` or `{"reward_error":
message}`. The first frame it writes is `{"ready": true}`, once the rewards are imported. It exits at the end of
stdin. Whatever the reward prints goes to stderr: stdout carries frames only.
"""
from __future__ import annotations

import os
import sys
from typing import Any

from rft.rewards import resolve
from rft.rewards.limits import read_frame, score_in_process, write_frame
from rft.rewards.registry import RewardError, TaskError
from rft.schema import TaskRecord


def main() -> int:
    frames = os.fdopen(os.dup(sys.stdout.fileno()), "wb")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # a reward's print() must not corrupt a frame

    functions: dict[str, Any] = {}
    write_frame(frames, {"ready": True})
    requests = sys.stdin.buffer
    while (request := read_frame(requests)) is not None:
        spec = str(request.get("reward", ""))
        try:
            if spec not in functions:
                kind, obj = resolve(spec)
                if kind != "function":
                    raise RewardError(f"reward {spec!r} is stateful (a factory): it runs in the explorer, not a worker")
                functions[spec] = obj
            task = TaskRecord(**request["task"])
            result = score_in_process(spec, functions[spec], str(request.get("response", "")), task)
            answer: dict[str, Any] = {"score": result.score, "components": result.components,
                                      "failure": result.failure}
        except TaskError as e:
            answer = {"task_error": str(e)}
        except (RewardError, TypeError, KeyError) as e:
            answer = {"reward_error": str(e)}
        write_frame(frames, answer)
    return 0


if __name__ == "__main__":
    sys.exit(main())
