"""tools/make_demonstrations.py: the expert conversations for SFT warm starts. Every frozenlake conversation,
replayed move by move in a fresh environment of its lake, shows that environment's observations and reaches the
goal on its last move (return 1); every calculator conversation calls the calculator in a block rft.agent_tools parses,
with the expression of its question, and answers reasoning-gym's answer, which the calculator's result equals."""
from __future__ import annotations

import importlib.util
import json
import random
from pathlib import Path

import pytest

from rft.agent_tools import parse_tool_calls
from rft.schema import TaskRecord
from rft.workflows.frozenlake import METADATA_KEY, FrozenLakeEnvironment, frozenlake_row


def _script_main():
    """tools/ holds scripts run from a checkout, not a package: load this one by its path."""
    path = Path(__file__).resolve().parents[2] / "tools" / "make_demonstrations.py"
    spec = importlib.util.spec_from_file_location("make_demonstrations", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main


main = _script_main()


def rows(tmp_path, kind: str, *flags: str) -> list[dict]:
    out = tmp_path / "demos.jsonl"
    assert main([kind, str(out), *flags]) == 0
    return [json.loads(line) for line in out.read_text().splitlines()]


def test_frozenlake_demonstrations_replay_to_the_goal(tmp_path):
    demos = rows(tmp_path, "frozenlake", "--count", "12", "--seed", "7", "--options", '{"size": 4}')
    assert len(demos) == 12 and len({d["prompt"] for d in demos}) > 1
    rng = random.Random(7)
    for demo in demos:
        row = frozenlake_row(rng, {"size": 4})  # the same lakes, drawn independently of the tool
        assert demo["prompt"] == row["prompt"]
        env = FrozenLakeEnvironment(TaskRecord("r", "t", 0, row["prompt"], metadata={METADATA_KEY: row[METADATA_KEY]}))
        turns = demo["answer"]
        assert [t["role"] for t in turns] == ["assistant", "user"] * (len(turns) // 2) + ["assistant"]
        for i, turn in enumerate(turns[::2]):
            step = env.step(turn["content"])
            if i < len(turns) // 2:
                assert not step.done and turns[2 * i + 1]["content"] == step.observation
        assert step.done and step.reward == 1.0


def test_calculator_demonstrations_call_the_tool_and_answer(tmp_path):
    demos = rows(tmp_path, "calculator", "--count", "8")
    assert len(demos) == 8
    for demo in demos:
        call, result, answer = demo["answer"]
        [parsed] = parse_tool_calls(call["content"])
        assert parsed.name == "calculator" and not parsed.error
        assert demo["prompt"] == f"Calculate {parsed.arguments['expression']}."
        assert result == {"role": "tool", "name": "calculator", "content": result["content"]}
        assert float(result["content"]) == float(answer["content"])


def test_slippery_lakes_are_refused(tmp_path):
    with pytest.raises(SystemExit, match="is_slippery: false"):
        main(["frozenlake", str(tmp_path / "x.jsonl"), "--options", '{"is_slippery": true}'])
