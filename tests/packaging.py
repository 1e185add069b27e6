"""What setup.py declares, read without running it: for the tests that keep the packaging consistent (GPU pins,
optional extras, what is installed)."""
from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def setup_requirements() -> tuple[list[str], dict[str, list[str]]]:
    """CORE and extras_require from setup.py, read with ast (importing it would run setup())."""
    tree = ast.parse((REPO / "setup.py").read_text())
    core = extras = None
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "CORE" for t in node.targets):
            core = ast.literal_eval(node.value)
        if isinstance(node, ast.keyword) and node.arg == "extras_require":
            extras = ast.literal_eval(node.value)
    return core, extras


def installed_packages() -> list[str]:
    """The packages `pip install` takes: setup.py's `find_packages(...)` call, its arguments read with ast, run on
    the repository."""
    from setuptools import find_packages

    tree = ast.parse((REPO / "setup.py").read_text())
    call = next(node.value for node in ast.walk(tree) if isinstance(node, ast.keyword) and node.arg == "packages")
    assert isinstance(call, ast.Call) and getattr(call.func, "id", None) == "find_packages", ast.dump(call)
    return find_packages(where=str(REPO), **{k.arg: ast.literal_eval(k.value) for k in call.keywords if k.arg})
