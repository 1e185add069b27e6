"""Tools of the tool_agent workflow: tool-call parsing (Hermes / Qwen2.5 blocks), the calculator against Python's own
arithmetic, and every bad call becoming an `error:` message instead of an exception (the python sandbox, which
starts interpreters: tests/integration/test_python_tool.py)."""
from __future__ import annotations

import json
import os
import random

import pytest

from rft.agent_tools import ToolBox, ToolCall, ToolLimits, parse_tool_calls
from rft.agent_tools.calculator import evaluate
from rft.agent_tools.registry import ToolError
from rft.agent_tools.sandbox import LOADER_FILES, TOP_LEVEL, ProcessLimits, sandboxed
from rft.config import ConfigError
from rft.run.loading import run_config_from_dict


def block(obj) -> str:
    return f"<tool_call>\n{obj if isinstance(obj, str) else json.dumps(obj)}\n</tool_call>"


@pytest.fixture(scope="module")
def box():
    """The python tool is built here, never run (its runs: tests/integration/test_python_tool.py), so without the
    sandbox: checking bwrap starts a process, which the unit tier refuses."""
    return ToolBox(["calculator", "python"], ToolLimits(timeout_s=1.0, memory_mb=256, output_chars=200, sandbox="none"))


def test_parse_tool_calls():
    text = ("I will compute. " + block({"name": "calculator", "arguments": {"expression": "1+2"}})
            + " then " + block('{"name": "python", "arguments": "{\\"code\\": \\"print(1)\\"}"}'))
    assert parse_tool_calls(text) == [ToolCall("calculator", {"expression": "1+2"}),
                                      ToolCall("python", {"code": "print(1)"})]
    assert parse_tool_calls("The answer is 5.") == []
    assert parse_tool_calls(block({"name": "calculator"})) == [ToolCall("calculator", {})]
    bad = parse_tool_calls(block("{not json") + block('["calculator"]') + block({"name": "c", "arguments": [1]})
                           + "<tool_call>{\"name\": \"calculator\"")
    assert [c.error for c in bad] == [
        "unparseable tool call: Expecting property name enclosed in double quotes at character 1 of '{not json'",
        'unparseable tool call: expected {"name": "...", "arguments": {...}}',
        "tool call arguments must be a JSON object",
        "unparseable tool call: <tool_call> without </tool_call>"]


def test_calculator_matches_python_arithmetic():
    rng = random.Random(0)
    ops = ["+", "-", "*", "/", "//", "%"]
    for _ in range(300):
        a, b, c = (rng.choice([rng.randint(-50, 50), round(rng.uniform(-9, 9), 2)]) for _ in range(3))
        expression = f"({a} {rng.choice(ops)} {b}) {rng.choice(ops)} {c}"
        try:
            expected = eval(expression)  # the reference: Python itself, on numbers we generated
        except ZeroDivisionError:
            with pytest.raises(ToolError, match="division by zero"):
                evaluate(expression)
            continue
        assert evaluate(expression) == expected, expression
    assert evaluate("2 ** 10") == 1024 and evaluate("-(3 + 4) * 2") == -14 and evaluate("7 / 2") == 3.5


@pytest.mark.parametrize("expression, message", [
    ("__import__('os')", "Call is not allowed"),
    ("x + 1", "Name is not allowed"),
    ("'a' * 3", "Constant is not allowed"),
    ("1 < 2", "Compare is not allowed"),
    ("9 ** 9 ** 9", "exponent .* is over 1000"),
    ("12345 ** 999", "over 4000 digits"),
    ("1 +", "not an arithmetic expression"),
    ("1" * 201, "over 200"),
])
def test_calculator_refuses(expression, message):
    with pytest.raises(ToolError, match=message):
        evaluate(expression)


def test_bad_calls_are_messages_not_crashes(box):
    text = (block({"name": "search", "arguments": {"q": "x"}}) + block("{oops")
            + block({"name": "calculator", "arguments": {"expr": "1"}})
            + block({"name": "calculator", "arguments": {"expression": 5}})
            + block({"name": "calculator", "arguments": {"expression": "1/0"}})
            + block({"name": "python", "arguments": {}}))
    results = [r for _, r in box.run_calls(text)]
    assert results == [
        "error: unknown tool 'search' (tools: calculator, python)",
        "error: unparseable tool call: Expecting property name enclosed in double quotes at character 1 of '{oops'",
        "error: calculator: missing argument 'expression'",
        "error: calculator: argument 'expression' must be a str, got int",
        "error: calculator: division by zero",
        "error: python: missing argument 'code'",
    ]

    class Broken:
        schema = {"type": "function", "function": {"name": "broken"}}

        def __init__(self, limits):
            pass

        def __call__(self, arguments):
            raise KeyError("boom")

    box.tools["broken"] = Broken(box.limits)
    try:
        assert box.run(ToolCall("broken", {})) == "error: broken failed: KeyError: 'boom'"
    finally:
        del box.tools["broken"]


@pytest.mark.parametrize("explorer, message", [
    ({"tools": ["calculater"]}, r"explorer.tools: unknown tool 'calculater' \(did you mean 'calculator'\?\)"),
    ({"tools": []}, "explorer.tools: must name at least one tool"),
    ({"tool_timeout_s": 0}, "explorer.tool_timeout_s: must be > 0"),
    ({"tool_memory_mb": 10}, "explorer.tool_memory_mb: must be >= 64"),
    ({"tool_output_chars": 0}, "explorer.tool_output_chars: must be >= 1"),
    ({"python_workdir_mb": 0}, r"explorer.python_workdir_mb: must be in \[1, 4096\]"),
])
def test_tool_config_errors_name_the_key(explorer, message):
    with pytest.raises(ConfigError, match=message):
        run_config_from_dict({"model": {"path": "not/on/disk"}, "explorer": {"workflow": "tool_agent", **explorer}})


def test_the_sandbox_binds_the_system_and_the_given_paths_only():
    """The python tool's bwrap argv (rft/agent_tools/sandbox.py), built but never run: nothing bound writable, no
    host path beyond /usr, the loader's files and `ro_paths` (the outermost of them; one under /usr is there
    already), both tmpfs capped, the limits set inside, as the command's user."""
    limits = ProcessLimits(cpu_s=2, memory_bytes=64 << 20, processes=8)
    argv = sandboxed(["python", "-I"], limits, workdir_bytes=3 << 20,
                     ro_paths=["/opt/py/lib", "/opt/py", "/usr/lib/python3", "/srv/venv"])
    binds = {argv[i + 1] for i, a in enumerate(argv) if a in ("--ro-bind", "--ro-bind-try")}
    system = {"/usr", *LOADER_FILES, *(t for t in TOP_LEVEL if os.path.isdir(t) and not os.path.islink(t))}
    assert binds == system | {"/opt/py", "/srv/venv"}, binds
    assert not {"--bind", "--bind-try", "--dev-bind", "--share-net"} & set(argv)
    assert [argv[i + 1] for i, a in enumerate(argv) if a == "--size"] == [str(3 << 20)] * 2
    assert [argv[i + 3] for i, a in enumerate(argv) if a == "--size"] == ["/dev/shm", "/tmp"]
    prlimit = argv.index("--as=67108864")
    assert argv.index("--unshare-user" if os.geteuid() else "--no-new-privs") < prlimit < argv.index("python")
    assert "--nproc=8" in argv and argv[-2:] == ["python", "-I"]
