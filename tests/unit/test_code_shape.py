"""Classes stay readable: no class in `rft/` or `megatron_bridge/` has more than MAX_METHODS methods, counted from the
source with `ast` as the `def`s directly in the class body (properties, dunders and static methods included; nested
classes count on their own). A class that outgrows it is split into named parts (rft/explorer/ is the example: the
loops, the pipeline and the membership watchdog beside a small `Explorer`)."""
from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
ROOTS = ("rft", "megatron_bridge")
MAX_METHODS = 20


def method_counts(source: str) -> list[tuple[str, int, int]]:
    """(class name, line, number of `def`s directly in its body) for every class in `source`, nested ones too."""
    return [(node.name, node.lineno, sum(isinstance(b, (ast.FunctionDef, ast.AsyncFunctionDef)) for b in node.body))
            for node in ast.walk(ast.parse(source)) if isinstance(node, ast.ClassDef)]


def oversized(repo: Path, roots: tuple[str, ...], limit: int) -> list[str]:
    found = []
    for root in roots:
        for path in sorted((repo / root).rglob("*.py")):
            for name, line, count in method_counts(path.read_text()):
                if count > limit:
                    found.append(f"{path.relative_to(repo)}:{line}: class {name} has {count} methods (at most {limit})")
    return found


def test_the_count_sees_properties_dunders_and_nested_classes_but_not_nested_functions():
    source = '''
class Big:
    def __init__(self): pass
    @property
    def p(self): pass
    async def a(self): pass
    def outer(self):
        def inner(): pass
    class Inner:
        def one(self): pass
    x = 1
'''
    assert sorted(method_counts(source)) == [("Big", 2, 4), ("Inner", 9, 1)]


def test_an_oversized_class_is_named_with_its_count(tmp_path):
    (tmp_path / "pkg").mkdir()
    body = "".join(f"    def m{i}(self): pass\n" for i in range(MAX_METHODS + 1))
    (tmp_path / "pkg" / "mod.py").write_text(f"class Fine:\n    def m(self): pass\n\n\nclass Wide:\n{body}")
    assert oversized(tmp_path, ("pkg",), MAX_METHODS) == [
        f"pkg/mod.py:5: class Wide has {MAX_METHODS + 1} methods (at most {MAX_METHODS})"]


def test_no_class_has_more_than_twenty_methods():
    found = oversized(REPO, ROOTS, MAX_METHODS)
    assert not found, "split these classes into named parts:\n" + "\n".join(found)
