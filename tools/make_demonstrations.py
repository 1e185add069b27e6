"""Expert demonstrations for a supervised warm start (an SFT stage before RL: docs/algorithms.md): JSONL rows
`{"prompt", "answer"}` whose answer is a conversation (rft/data/demonstrations.py: assistant turns trained, tool and
user turns masked), written by playing each episode with a scripted expert through rft's own tools and
environments, so every tool result and observation is the text the explorers will show.

    python tools/make_demonstrations.py calculator OUT.jsonl [--count 200] [--seed 1000] [--options JSON]
    python tools/make_demonstrations.py frozenlake OUT.jsonl [--count 200] [--seed 1000] [--options JSON]

- `calculator`: reasoning-gym `basic_arithmetic` questions (`--options`: its options, default two-term 2-3 digit
  arithmetic, as configs/smollm2-tools.yaml's RL stage). The expert calls the calculator on the task's expression
  (a `<tool_call>` block in the Hermes format rft.agent_tools parses), gets its result from rft's calculator, and
  answers reasoning-gym's answer.
- `frozenlake`: lakes as `data.path: frozenlake` generates them (`--options`: `size`, `p`, `is_slippery`; a
  slippery lake is refused: a scripted path does not survive slips). The expert plays a shortest path (BFS over the
  map), one move word per turn, and each observation is the environment's own text after that move.
Prompts are the raw task prompts: the config's `data.prompt_template` is applied when the rows are published, as
for the RL stage's tasks. The seed picks the tasks; use another than the RL stage's to keep them apart.
"""
from __future__ import annotations

import argparse
import json
import random
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from rft.agent_tools import ToolBox, ToolLimits
from rft.schema import TaskRecord
from rft.workflows.frozenlake import ACTIONS, METADATA_KEY, FrozenLakeEnvironment, frozenlake_row, shortest_path

CALCULATOR_OPTIONS = {"min_terms": 2, "max_terms": 2, "min_digits": 2, "max_digits": 3}


def tool_call(name: str, arguments: dict[str, Any]) -> str:
    """A model turn calling one tool, in the Hermes format (rft.agent_tools.registry parses it)."""
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def calculator_rows(count: int, seed: int, options: dict[str, Any]) -> Iterator[dict[str, Any]]:
    import reasoning_gym  # heavy: reasoning-gym

    toolbox = ToolBox(["calculator"], ToolLimits())
    for item in reasoning_gym.create_dataset("basic_arithmetic", size=count, seed=seed, **options):
        call = tool_call("calculator", {"expression": item["metadata"]["expression"]})
        [(_, result)] = toolbox.run_calls(call)
        yield {"prompt": item["question"], "answer": [
            {"role": "assistant", "content": call},
            {"role": "tool", "name": "calculator", "content": result},
            {"role": "assistant", "content": str(item["answer"])}]}


def frozenlake_rows(count: int, seed: int, options: dict[str, Any]) -> Iterator[dict[str, Any]]:
    if options.get("is_slippery"):
        raise SystemExit("frozenlake demonstrations need is_slippery: false (a scripted path does not survive slips)")
    rng = random.Random(seed)
    for i in range(count):
        row = frozenlake_row(rng, options)
        task = TaskRecord(run_id="demonstrations", task_id=str(i), epoch=0, prompt=row["prompt"],
                          metadata={METADATA_KEY: row[METADATA_KEY]})
        environment = FrozenLakeEnvironment(task)
        turns: list[dict[str, str]] = []
        for action in shortest_path(environment.rows):
            turns.append({"role": "assistant", "content": ACTIONS[action]})
            step = environment.step(ACTIONS[action])
            if step.done:
                if step.reward != 1.0:
                    raise AssertionError(f"lake {row[METADATA_KEY]}: the shortest path ended with {step.reward}")
                break
            turns.append({"role": "user", "content": step.observation})
        yield {"prompt": row["prompt"], "answer": turns}


KINDS = {"calculator": (calculator_rows, CALCULATOR_OPTIONS), "frozenlake": (frozenlake_rows, {"size": 3})}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python tools/make_demonstrations.py", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("kind", choices=sorted(KINDS))
    parser.add_argument("out", type=Path)
    parser.add_argument("--count", type=int, default=200)
    parser.add_argument("--seed", type=int, default=1000)
    parser.add_argument("--options", type=json.loads, default=None, help="the task set's options, as JSON")
    args = parser.parse_args(argv)
    if args.count < 1:
        parser.error(f"--count must be >= 1, got {args.count}")
    rows, options = KINDS[args.kind]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    written = 0
    with args.out.open("w") as f:
        for row in rows(args.count, args.seed, args.options or options):
            f.write(json.dumps(row) + "\n")
            written += 1
    print(f"[demonstrations] {args.out}: {written} {args.kind} conversations", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
