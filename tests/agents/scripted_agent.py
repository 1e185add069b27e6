"""An agent program for tests/integration/test_agent_program_sandbox.py, run by the agent_program workflow: it reads
its task from stdin and does what the task's `metadata.mode` says.

  two_turn  two calls through the official `openai` client (the first with a tool, the second with the first reply
            and a tool result added), then the answer `{"answer": "5"}`
The other modes make their one call with the standard library (importing `openai` takes seconds of CPU):
  escape    one call, then tries what the sandbox must prevent: reach 127.0.0.1:`metadata.port` (a listener of the
            host) and 8.8.8.8:53, read the variable `metadata.secret_env`; `{"reward": 1.0}` when everything was
            refused, else `{"reward": 0.0, "escaped": [...]}`
  crash     one call, then an exception (exit status 1)
  hang      one call, then sleeps past any limit
  unscored  one call, then `{"reward": null}`
"""
from __future__ import annotations

import json
import os
import socket
import sys
import time
import urllib.request

TOOLS = [{"type": "function", "function": {"name": "calculator", "description": "evaluate an expression",
                                             "parameters": {"type": "object", "properties": {
                                                 "expression": {"type": "string"}}, "required": ["expression"]}}}]


def reachable(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=2):
            return True
    except OSError:
        return False


def main() -> None:
    task = json.load(sys.stdin)
    mode = task["metadata"]["mode"]
    messages: list = [{"role": "user", "content": task["prompt"]}]
    if mode == "two_turn":
        import openai

        client = openai.OpenAI(max_retries=0, timeout=120)  # OPENAI_BASE_URL and OPENAI_API_KEY from the environment
        first = client.chat.completions.create(model="policy", messages=messages, tools=TOOLS, max_tokens=6)
        messages += [first.choices[0].message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": "call_1", "content": "5"}]
        client.chat.completions.create(model="policy", messages=messages, tools=TOOLS, max_tokens=6)
        print(json.dumps({"answer": "5"}))
        return
    request = urllib.request.Request(
        os.environ["OPENAI_BASE_URL"] + "/chat/completions", method="POST",
        data=json.dumps({"model": "policy", "messages": messages, "max_tokens": 4}).encode(),
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {os.environ['OPENAI_API_KEY']}"})
    with urllib.request.urlopen(request, timeout=60) as response:
        json.load(response)
    if mode == "escape":
        escaped = [f"127.0.0.1:{task['metadata']['port']}"] if reachable("127.0.0.1", task["metadata"]["port"]) else []
        escaped += ["8.8.8.8:53"] if reachable("8.8.8.8", 53) else []
        escaped += [task["metadata"]["secret_env"]] if os.environ.get(task["metadata"]["secret_env"]) else []
        print(json.dumps({"reward": 0.0, "escaped": escaped} if escaped else {"reward": 1.0}))
    elif mode == "crash":
        raise RuntimeError("the agent crashed")
    elif mode == "hang":
        time.sleep(3600)
    elif mode == "unscored":
        print(json.dumps({"reward": None}))


if __name__ == "__main__":
    main()
