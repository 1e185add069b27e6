"""Toy tasks for the CPU quickstart and tests: tiny char-level models learn them with RL in minutes.

- `copy_char`: prompt ":7" -> answer "7" (repeat the single character after the colon).
- `next_digit`: prompt "+7" -> answer "8" (the digit that follows, 9 -> 0).
Answers are one character from `ALPHABET` (the ten digits); rows carry it as `alphabet`, which the `char_accuracy`
reward uses for partial credit. Pair them with `explorer.max_tokens: 1`: the response is then exactly one character
and the reward is 1, 0.25 or 0 (learning curves: docs/benchmarks.md).

`python -m rft.data.toy_tasks copy_char out.jsonl --count 1000 --seed 0` writes a JSONL dataset (`prompt`, `answer`,
`alphabet`); `data.format: generated` with `data.path: copy_char` generates the same rows in the task publisher.

Environment tasks for the multi_turn workflow are generated here too, by the environment's own module (`frozenlake`,
`textarena`), named by import path and imported on first use (the workflows sit above this package, and their
extras are optional); each row's seed is drawn from the set's seed, and `data.options` (`--options JSON`) sets the
environment's options. A JSONL file of them works as `data.format: jsonl`: the spec is the row's metadata.
"""
from __future__ import annotations

import argparse
import json
import random
import string
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rft.registry import import_object

ALPHABET = string.digits


def _char_task(make: Callable[[str], tuple[str, str]]) -> Callable[[random.Random, dict[str, Any]], dict]:
    def row(rng: random.Random, options: dict[str, Any]) -> dict:
        if options:
            raise ValueError(f"this toy task takes no options; got {sorted(options)}")
        prompt, answer = make(rng.choice(ALPHABET))
        return {"prompt": prompt, "answer": answer, "alphabet": ALPHABET}
    return row


Row = Callable[[random.Random, dict[str, Any]], dict]

# name -> row(rng, options): one row from the set's generator and its `data.options` (ValueError naming a bad one);
# an environment's rows by the import path of its row function (imported on first use)
TOY_TASKS: dict[str, Row | str] = {
    "copy_char": _char_task(lambda c: (f":{c}", c)),
    "next_digit": _char_task(lambda d: (f"+{d}", ALPHABET[(int(d) + 1) % 10])),
    "frozenlake": "rft.workflows.frozenlake:frozenlake_row",
    "textarena": "rft.workflows.textarena_game:textarena_row",
}


def row_function(task: str) -> Row:
    """The row function of toy task `task` (ValueError naming the known tasks if there is none)."""
    if task not in TOY_TASKS:
        raise ValueError(f"unknown toy task {task!r}; choose one of {', '.join(TOY_TASKS)}")
    row = TOY_TASKS[task]
    return import_object(row, key="data.path", error=ValueError) if isinstance(row, str) else row


def generate_rows(task: str, count: int, *, seed: int = 0, options: dict[str, Any] | None = None) -> list[dict]:
    """`count` rows of toy task `task` (same seed and options, same rows)."""
    row = row_function(task)
    if count < 1:
        raise ValueError(f"count must be >= 1, got {count}")
    rng = random.Random(seed)
    return [row(rng, dict(options or {})) for _ in range(count)]


def write_jsonl(path: str | Path, task: str, count: int, *, seed: int = 0,
                options: dict[str, Any] | None = None) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for row in generate_rows(task, count, seed=seed, options=options):
            f.write(json.dumps(row) + "\n")
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rft.data.toy_tasks", description=__doc__.split("\n")[0])
    parser.add_argument("task", choices=sorted(TOY_TASKS))
    parser.add_argument("out", help="JSONL file to write")
    parser.add_argument("--count", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--options", type=json.loads, default={}, help='the task\'s options as JSON: \'{"size": 5}\'')
    args = parser.parse_args(argv)
    print(write_jsonl(args.out, args.task, args.count, seed=args.seed, options=args.options))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
